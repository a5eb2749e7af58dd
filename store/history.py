"""Async repository of users, conversations and their messages' exact token streams."""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import ScalarSelect, delete, func, or_, select, update
from sqlalchemy.engine import URL
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker
from sqlalchemy.orm import aliased

from store.db import make_engine
from store.models import (
    ROLES,
    ApiResponse,
    Conversation,
    ConversationRetention,
    Message,
    User,
    utcnow,
)

MAX_TITLE = 200
FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclass(frozen=True)
class PrefixMatch:
    """A stored reply whose prefix hash a request shares."""

    conversation_id: str
    seq: int  # the reply's position: the request's first seq + 1 messages match
    prefix_hash: str
    last_seq: int  # the conversation's last message
    updated: datetime


class HistoryError(KeyError):
    """Asked for tokens or a conversation the store does not hold."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class HistoryConflict(HistoryError):
    """The stream grew under the caller: its tokens would land at another position."""


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_id() -> str:
    return uuid.uuid4().hex


def _window_seq(conversation_id: str) -> ScalarSelect[int]:
    """seq of the message that opens the conversation's context window (0: the first)."""
    return (
        select(func.coalesce(func.max(Message.seq), 0))
        .where(Message.conversation_id == conversation_id, Message.starts_context.is_(True))
        .scalar_subquery()
    )


def _in_window(conversation_id: str):
    return (Message.conversation_id == conversation_id) & (
        Message.seq >= _window_seq(conversation_id)
    )


def _check_tokens(token_ids: Sequence[int]) -> list[int]:
    ids = list(token_ids)
    for t in ids:
        # bool is an int subclass; a True in a token stream is a bug upstream.
        if type(t) is not int or t < 0:
            raise ValueError(f"token ids must be non-negative ints, got {t!r}")
    return ids


class HistoryStore:
    """Conversations and messages in SQL; every operation runs on the loop given to start()."""

    def __init__(self, url: str | URL, **engine_kwargs) -> None:
        self.url = url
        self.engine: AsyncEngine = make_engine(url, **engine_kwargs)
        self.sessions = async_sessionmaker(self.engine, expire_on_commit=False)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None

    async def start(self) -> None:
        """Remember the running loop (TokenHistory.read submits onto it) and check the link."""
        try:
            async with self.engine.connect() as conn:
                await conn.execute(select(1))
        except (OSError, SQLAlchemyError) as e:
            where = self.engine.url.render_as_string(hide_password=True)
            raise RuntimeError(f"cannot reach the database at {where}: {e}") from e
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()

    async def close(self) -> None:
        await self.engine.dispose()
        self._loop = None

    async def __aenter__(self) -> HistoryStore:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # Users.

    async def create_user(self, name: str) -> tuple[User, str]:
        """A new owner and its bearer token; the token is returned only here, never stored."""
        name = name.strip()
        if not name or len(name) > 200:
            raise ValueError("user name must be 1 to 200 characters")
        token = secrets.token_urlsafe(32)
        user = User(id=new_id(), name=name, token_hash=hash_token(token), created=utcnow())
        async with self.sessions.begin() as s:
            s.add(user)
        return user, token

    async def user_by_token(self, token: str) -> User | None:
        if not token:
            return None
        async with self.sessions() as s:
            return await s.scalar(select(User).where(User.token_hash == hash_token(token)))

    async def get_user(self, user_id: str) -> User | None:
        async with self.sessions() as s:
            return await s.get(User, user_id)

    # Conversations.

    async def create_conversation(
        self,
        owner_id: str,
        title: str = "",
        system_prompt: str | None = None,
        session_key: str | None = None,
        api_metadata: dict | None = None,
    ) -> Conversation:
        if len(title) > MAX_TITLE:
            raise ValueError(f"title is longer than {MAX_TITLE} characters")
        now = utcnow()
        conv = Conversation(
            id=new_id(),
            owner_id=owner_id,
            title=title,
            system_prompt=system_prompt,
            created=now,
            updated=now,
            session_key=session_key,
            api_metadata=api_metadata,
        )
        async with self.sessions.begin() as s:
            if await s.get(User, owner_id) is None:
                raise HistoryError(f"unknown user {owner_id!r}")
            s.add(conv)
        return conv

    async def get_conversation(
        self, conversation_id: str, owner_id: str | None = None
    ) -> Conversation | None:
        """The conversation, or None when unknown (or not owned by `owner_id` when given)."""
        q = select(Conversation).where(Conversation.id == conversation_id)
        if owner_id is not None:
            q = q.where(Conversation.owner_id == owner_id)
        async with self.sessions() as s:
            return await s.scalar(q)

    async def conversation_by_key(self, owner_id: str, key: str) -> Conversation | None:
        """The owner's most recent conversation named `key` by an API client."""
        q = (
            select(Conversation)
            .where(Conversation.owner_id == owner_id, Conversation.session_key == key)
            .order_by(Conversation.updated.desc())
            .limit(1)
        )
        async with self.sessions() as s:
            return await s.scalar(q)

    async def find_prefixes(self, owner_id: str, hashes: Sequence[str]) -> list[PrefixMatch]:
        """The owner's replies whose prefix hash is one of `hashes` (an index lookup per
        hash), each with its conversation's last seq and update time."""
        if not hashes:
            return []
        other = aliased(Message)
        last = (
            select(func.max(other.seq))
            .where(other.conversation_id == Conversation.id)
            .correlate(Conversation)
            .scalar_subquery()
        )
        q = (
            select(
                Message.conversation_id,
                Message.seq,
                Message.prefix_hash,
                last,
                Conversation.updated,
            )
            .join(Conversation, Conversation.id == Message.conversation_id)
            .where(Conversation.owner_id == owner_id, Message.prefix_hash.in_(list(hashes)))
        )
        async with self.sessions() as s:
            return [PrefixMatch(*row) for row in (await s.execute(q)).all()]

    async def rewind(self, conversation_id: str, keep: int, system_prompt: str | None) -> bool:
        """Keep only the first `keep` messages and set the system prompt, in one transaction
        (a client edited or cut the chat). True when a message that opened a context window
        went, i.e. the model's stream now is an older window."""
        async with self.sessions.begin() as s:
            res = await s.execute(  # the append lock, as in append_message
                update(Conversation)
                .where(Conversation.id == conversation_id)
                .values(updated=utcnow(), system_prompt=system_prompt)
            )
            if res.rowcount == 0:
                raise HistoryError(f"unknown conversation {conversation_id!r}")
            gone = Message.conversation_id == conversation_id, Message.seq >= keep
            opener = await s.scalar(
                select(func.count()).where(*gone, Message.starts_context.is_(True))
            )
            await s.execute(delete(Message).where(*gone))
            return bool(opener)

    async def list_conversations(self, owner_id: str, limit: int = 200) -> list[Conversation]:
        """The owner's conversations, most recently updated first."""
        q = (
            select(Conversation)
            .where(Conversation.owner_id == owner_id)
            .order_by(Conversation.updated.desc(), Conversation.id)
            .limit(limit)
        )
        async with self.sessions() as s:
            return list(await s.scalars(q))

    async def set_title(self, conversation_id: str, title: str) -> None:
        if len(title) > MAX_TITLE:
            raise ValueError(f"title is longer than {MAX_TITLE} characters")
        async with self.sessions.begin() as s:
            res = await s.execute(
                update(Conversation).where(Conversation.id == conversation_id).values(title=title)
            )
            if res.rowcount == 0:
                raise HistoryError(f"unknown conversation {conversation_id!r}")

    async def delete_conversation(self, conversation_id: str, owner_id: str | None = None) -> bool:
        """Delete a conversation and (by ON DELETE CASCADE) its messages; False if not found."""
        q = delete(Conversation).where(Conversation.id == conversation_id)
        if owner_id is not None:
            q = q.where(Conversation.owner_id == owner_id)
        async with self.sessions.begin() as s:
            res = await s.execute(q)
            return res.rowcount > 0

    # Messages.

    async def append_message(
        self,
        conversation_id: str,
        role: str,
        content: str,
        token_ids: Sequence[int],
        finish_reason: str | None = None,
        expected_start: int | None = None,
        starts_context: bool = False,
        prefix_hash: str | None = None,
        item_id: str | None = None,
    ) -> Message:
        """Append a message at the end of the conversation, in one transaction.

        seq and token_start follow the last stored message; concurrent appends to one
        conversation are serialised by the row lock the first UPDATE takes. With
        `expected_start`, the append is refused (HistoryConflict, nothing written) unless
        the stream is exactly that long, i.e. the tokens land where the caller computed.
        With `starts_context` the message opens a new context window at position 0 (its
        tokens hold the whole new prompt); `expected_start` still guards the old stream."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if finish_reason is not None and finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS} or None")
        ids = _check_tokens(token_ids)
        now = utcnow()
        async with self.sessions.begin() as s:
            # Writing the conversation row first takes its lock before anything is read:
            # a row lock on PostgreSQL (like SELECT ... FOR UPDATE), the database write
            # lock on SQLite (waiting on the busy timeout, with no stale read snapshot).
            res = await s.execute(
                update(Conversation).where(Conversation.id == conversation_id).values(updated=now)
            )
            if res.rowcount == 0:
                raise HistoryError(f"unknown conversation {conversation_id!r}")
            last = (
                await s.execute(
                    select(Message.seq, Message.token_start + Message.token_count)
                    .where(Message.conversation_id == conversation_id)
                    .order_by(Message.seq.desc())
                    .limit(1)
                )
            ).first()
            seq, start = (last[0] + 1, last[1]) if last else (0, 0)
            if expected_start is not None and start != expected_start:
                raise HistoryConflict(
                    f"conversation {conversation_id!r} has {start} tokens, "
                    f"the new message expected {expected_start}"
                )
            if starts_context:
                start = 0
            msg = Message(
                conversation_id=conversation_id,
                seq=seq,
                role=role,
                content=content,
                token_ids=ids,
                token_start=start,
                token_count=len(ids),
                created=now,
                finish_reason=finish_reason,
                starts_context=starts_context,
                prefix_hash=prefix_hash,
                item_id=item_id,
            )
            s.add(msg)
        return msg

    async def delete_last_message(self, conversation_id: str, message_id: int) -> bool:
        """Take back a message the engine refused, if it is still the last one."""
        async with self.sessions.begin() as s:
            await s.execute(  # the append lock: nothing lands behind it meanwhile
                update(Conversation)
                .where(Conversation.id == conversation_id)
                .values(updated=utcnow())
            )
            last = await s.scalar(
                select(func.max(Message.seq)).where(Message.conversation_id == conversation_id)
            )
            res = await s.execute(
                delete(Message).where(
                    Message.id == message_id,
                    Message.conversation_id == conversation_id,
                    Message.seq == last,
                )
            )
            return res.rowcount > 0

    async def truncate(self, conversation_id: str, length: int) -> None:
        """Cut the context window's token stream to its first `length` tokens, in one
        transaction.

        For chat templates that are not prefix-stable: messages keep their text, the
        tokens past the cut are dropped, so the stream stays what the engine holds."""
        if length < 0:
            raise ValueError(f"bad stream length {length}")
        async with self.sessions.begin() as s:
            # Same lock as append_message: a cut never interleaves with an append.
            res = await s.execute(
                update(Conversation)
                .where(Conversation.id == conversation_id)
                .values(updated=utcnow())
            )
            if res.rowcount == 0:
                raise HistoryError(f"unknown conversation {conversation_id!r}")
            rows = (
                await s.scalars(
                    select(Message)
                    .where(
                        _in_window(conversation_id),
                        Message.token_start + Message.token_count > length,
                    )
                    .order_by(Message.seq)
                )
            ).all()
            if rows and rows[0].token_start > length:
                raise HistoryError(f"history of {conversation_id!r} is shorter than {length}")
            if not rows:
                total = await s.scalar(
                    select(func.coalesce(func.sum(Message.token_count), 0)).where(
                        _in_window(conversation_id)
                    )
                )
                if (total or 0) < length:
                    raise HistoryError(
                        f"history of {conversation_id!r} has {total} tokens, cannot cut to {length}"
                    )
            for m in rows:
                keep = max(0, length - m.token_start)
                m.token_ids = list(m.token_ids[:keep])
                m.token_start = min(m.token_start, length)
                m.token_count = keep

    async def messages(self, conversation_id: str) -> list[Message]:
        """All messages in seq order, those before the context window too."""
        async with self.sessions() as s:
            return list(
                await s.scalars(
                    select(Message)
                    .where(Message.conversation_id == conversation_id)
                    .order_by(Message.seq)
                )
            )

    async def last_message_id(self, conversation_id: str) -> int | None:
        """Id of the conversation's last message (None: it has none)."""
        q = (
            select(Message.id)
            .where(Message.conversation_id == conversation_id)
            .order_by(Message.seq.desc())
            .limit(1)
        )
        async with self.sessions() as s:
            return await s.scalar(q)

    async def fork_conversation(
        self, conversation_id: str, message_id: int, system_prompt: str | None
    ) -> Conversation | None:
        """A new conversation of the same owner holding a copy of this one's messages up to
        message `message_id` (token ids, positions and context windows included), in one
        transaction; None when that message is not in the conversation. With another
        system prompt the copies lose their prefix hashes (which hash the prompt too)."""
        async with self.sessions.begin() as s:
            src = await s.get(Conversation, conversation_id)
            upto = await s.scalar(
                select(Message.seq).where(
                    Message.id == message_id, Message.conversation_id == conversation_id
                )
            )
            if src is None or upto is None:
                return None
            now = utcnow()
            conv = Conversation(
                id=new_id(),
                owner_id=src.owner_id,
                title=src.title,
                system_prompt=system_prompt,
                created=now,
                updated=now,
            )
            s.add(conv)
            same = (src.system_prompt or None) == (system_prompt or None)
            rows = await s.scalars(
                select(Message)
                .where(Message.conversation_id == conversation_id, Message.seq <= upto)
                .order_by(Message.seq)
            )
            for m in rows:
                s.add(
                    Message(
                        conversation_id=conv.id,
                        seq=m.seq,
                        role=m.role,
                        content=m.content,
                        token_ids=list(m.token_ids),
                        token_start=m.token_start,
                        token_count=m.token_count,
                        created=m.created,
                        finish_reason=m.finish_reason,
                        starts_context=m.starts_context,
                        prefix_hash=m.prefix_hash if same else None,
                    )
                )
        return conv

    # Responses (the OpenAI Responses API).

    async def add_response(
        self, response: ApiResponse, reply_item_id: str | None, input_item_ids: Sequence[str]
    ) -> None:
        """Store a response; its reply and the input messages stored just before it take
        the item ids the API gave them, in the same transaction."""
        async with self.sessions.begin() as s:
            s.add(response)
            reply = await s.get(Message, response.message_id) if response.message_id else None
            if reply is None:
                return
            reply.item_id = reply_item_id
            n = len(input_item_ids)
            rows = list(
                await s.scalars(
                    select(Message)
                    .where(
                        Message.conversation_id == reply.conversation_id,
                        Message.seq < reply.seq,
                        Message.seq >= reply.seq - n,
                    )
                    .order_by(Message.seq)
                )
            )
            for m, item_id in zip(rows, input_item_ids[n - len(rows) :], strict=True):
                m.item_id = item_id

    async def get_response(self, response_id: str, owner_id: str) -> ApiResponse | None:
        q = select(ApiResponse).where(
            ApiResponse.id == response_id, ApiResponse.owner_id == owner_id
        )
        async with self.sessions() as s:
            return await s.scalar(q)

    async def delete_response(self, response_id: str, owner_id: str) -> bool:
        q = delete(ApiResponse).where(
            ApiResponse.id == response_id, ApiResponse.owner_id == owner_id
        )
        async with self.sessions.begin() as s:
            return (await s.execute(q)).rowcount > 0

    # Retention (what a conversation's client asked the cache to keep, across restarts).

    async def save_retention(self, row: ConversationRetention) -> None:
        """Store the conversation's retention, replacing what was stored of it."""
        async with self.sessions.begin() as s:
            await s.merge(row)

    async def clear_retention(self, conversation_id: str) -> None:
        async with self.sessions.begin() as s:
            await s.execute(
                delete(ConversationRetention).where(
                    ConversationRetention.conversation_id == conversation_id
                )
            )

    async def live_retention(
        self, replica: str | None, now: datetime
    ) -> list[ConversationRetention]:
        """The retention of `replica`'s conversations (None: a lone server's) that still
        holds something at `now`: a pin in force, a priority, a finished session."""
        r = ConversationRetention
        here = r.replica.is_(None) if replica is None else r.replica == replica
        q = select(r).where(here, or_(r.pinned_until > now, r.priority != 50, r.done))
        async with self.sessions() as s:
            return list(await s.scalars(q))

    async def token_count(self, conversation_id: str) -> int:
        """Length of the context window's token stream."""
        async with self.sessions() as s:
            n = await s.scalar(
                select(func.coalesce(func.sum(Message.token_count), 0)).where(
                    _in_window(conversation_id)
                )
            )
            return int(n or 0)

    async def stream(self, conversation_id: str) -> list[int]:
        """The model's token stream: the token ids of the context window's messages."""
        async with self.sessions() as s:
            rows = await s.scalars(
                select(Message.token_ids).where(_in_window(conversation_id)).order_by(Message.seq)
            )
            return [t for ids in rows for t in ids]

    async def read(self, conversation_id: str, start: int, end: int) -> list[int]:
        """Exactly positions [start, end) of the window's stream; only overlapping rows are
        fetched."""
        if not 0 <= start <= end:
            raise ValueError(f"bad token range [{start}, {end})")
        if start == end:
            return []
        async with self.sessions() as s:
            rows = (
                await s.execute(
                    select(Message.token_start, Message.token_ids)
                    .where(
                        _in_window(conversation_id),
                        Message.token_start < end,
                        Message.token_start + Message.token_count > start,
                    )
                    .order_by(Message.seq)
                )
            ).all()
        if not rows or rows[0][0] > start:
            raise HistoryError(f"history of {conversation_id!r} does not cover [{start}, {end})")
        first = rows[0][0]
        tokens = [t for _, ids in rows for t in ids][start - first : end - first]
        if len(tokens) != end - start:
            raise HistoryError(
                f"history of {conversation_id!r} ends before {end}, asked for [{start}, {end})"
            )
        return tokens

    def token_history(self, timeout: float = 30.0) -> TokenHistory:
        """A synchronous reader for the engine's worker threads (needs start())."""
        if self._loop is None:
            raise RuntimeError("HistoryStore.start() must run before token_history()")
        return TokenHistory(self, timeout)

    async def count_conversations(self, owner_id: str) -> int:
        """How many conversations the owner has (for the per-owner quota)."""
        q = select(func.count()).select_from(Conversation).where(Conversation.owner_id == owner_id)
        async with self.sessions() as s:
            return int(await s.scalar(q) or 0)


class TokenHistory:
    """The engine's TokenHistory over a HistoryStore: blocking reads from worker threads."""

    def __init__(self, store: HistoryStore, timeout: float = 30.0) -> None:
        self.store = store
        self.timeout = timeout

    def read(self, conversation_id: str, start: int, end: int) -> list[int]:
        loop = self.store._loop
        if loop is None or loop.is_closed():
            raise RuntimeError("the history store is not running (start() it on the app loop)")
        if threading.get_ident() == self.store._loop_thread:
            raise RuntimeError(
                "TokenHistory.read blocks; call it from a worker thread, not the event loop"
            )
        fut = asyncio.run_coroutine_threadsafe(self.store.read(conversation_id, start, end), loop)
        try:
            return fut.result(self.timeout)
        except TimeoutError:
            fut.cancel()
            raise TimeoutError(
                f"reading tokens [{start}, {end}) of {conversation_id!r} took over {self.timeout}s"
            ) from None
