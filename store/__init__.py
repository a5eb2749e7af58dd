"""Persistence: SQL conversation history (SQLAlchemy + Alembic) and the Redis activity clock.

Typical start-up, on the server's event loop:

    migrate.upgrade(url)                 # schema to head (runs Alembic in a thread)
    history = HistoryStore(url)
    await history.start()                # binds it to this loop
    tokens = history.token_history()     # the engine's TokenHistory (blocking, worker threads)
    clock = RedisClock(redis_url)
    await clock.start()                  # the engine's ActivityClock; clock.healthy for /healthz
    ...
    await clock.stop(); await history.close()
"""

from store.activity import RedisClock
from store.base import HistoryConflict, HistoryError
from store.db import DEFAULT_URL, database_url
from store.history import HistoryStore, TokenHistory
from store.models import ApiResponse, Conversation, ConversationRetention, Message, User
from store.owners import hash_token

__all__ = [
    "ApiResponse",
    "DEFAULT_URL",
    "Conversation",
    "ConversationRetention",
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
