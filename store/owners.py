"""Owners: users and their bearer tokens, and the per-owner conversation quota."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import func, select

from store.base import StorePart, new_id
from store.models import Conversation, User, utcnow


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Owners(StorePart):
    """Users, their tokens (only hashes are stored) and how many conversations each has."""

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

    async def count_conversations(self, owner_id: str) -> int:
        """How many conversations the owner has (for the per-owner quota)."""
        q = select(func.count()).select_from(Conversation).where(Conversation.owner_id == owner_id)
        async with self.sessions() as s:
            return int(await s.scalar(q) or 0)
