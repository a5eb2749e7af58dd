"""Persistence: SQL conversation history (SQLAlchemy + Alembic) and the Redis activity clock."""

from store.activity import RedisClock
from store.db import DEFAULT_URL, database_url
from store.history import HistoryConflict, HistoryError, HistoryStore, TokenHistory, hash_token
from store.models import Conversation, Message, User

__all__ = [
    "DEFAULT_URL",
    "Conversation",
    "HistoryConflict",
    "HistoryError",
    "HistoryStore",
    "Message",
    "RedisClock",
    "TokenHistory",
    "User",
    "database_url",
    "hash_token",
]
