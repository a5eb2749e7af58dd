"""What the parts of the history store share: their session maker, errors and new ids."""

from __future__ import annotations

import uuid

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker


class HistoryError(KeyError):
    """Asked for tokens or a conversation the store does not hold."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class HistoryConflict(HistoryError):
    """The stream grew under the caller: its tokens would land at another position."""


def new_id() -> str:
    return uuid.uuid4().hex


class StorePart:
    """A part of `HistoryStore`: its queries over the sessions the store makes."""

    sessions: async_sessionmaker[AsyncSession]
