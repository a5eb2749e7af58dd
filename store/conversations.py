"""Conversations: create, look up, list, title, delete, fork; replies found by prefix hash."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import aliased

from store.base import HistoryError, StorePart, new_id
from store.models import Conversation, Message, User, utcnow

MAX_TITLE = 200


@dataclass(frozen=True)
class PrefixMatch:
    """A stored reply whose prefix hash a request shares."""

    conversation_id: str
    seq: int  # the reply's position: the request's first seq + 1 messages match
    prefix_hash: str
    last_seq: int  # the conversation's last message
    updated: datetime


class Conversations(StorePart):
    """Conversation rows; a fork copies its messages too."""

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

    async def recent_conversation_ids(self, limit: int) -> list[str]:
        """Every owner's conversations, most recently updated first (a restart's KV events
        announce what the disk tier holds of them)."""
        q = select(Conversation.id).order_by(Conversation.updated.desc()).limit(limit)
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
