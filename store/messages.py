"""A conversation's messages and the model's token stream they hold: append, take back,
rewind, cut, and exact reads of the context window."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import ScalarSelect, delete, func, select, update

from store.base import HistoryConflict, HistoryError, StorePart
from store.models import ROLES, Conversation, Message, utcnow

FINISH_REASONS = ("stop", "length", "cancelled", "error")


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


class Messages(StorePart):
    """Messages in seq order; each holds its exact token ids at their place in the stream."""

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
