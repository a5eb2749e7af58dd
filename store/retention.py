"""Retention rows: what a conversation's client asked the cache to keep, across restarts."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, or_, select

from store.base import StorePart
from store.models import ConversationRetention


class RetentionRows(StorePart):
    """One retention row per conversation, replaced at each turn's end."""

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
