"""The async repository of users, conversations and their messages' exact token streams:
`HistoryStore`, made of its parts, and the engine's blocking `TokenHistory` over it."""

from __future__ import annotations

import asyncio
import threading

from sqlalchemy import select
from sqlalchemy.engine import URL
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker

from store.conversations import Conversations
from store.db import make_engine
from store.messages import Messages
from store.owners import Owners
from store.responses import Responses
from store.retention import RetentionRows


class HistoryStore(Owners, Conversations, Messages, Responses, RetentionRows):
    """Conversations and messages in SQL; every operation runs on the loop given to start().

    One object for its callers; each part holds one kind of row's queries."""

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

    def token_history(self, timeout: float = 30.0) -> TokenHistory:
        """A synchronous reader for the engine's worker threads (needs start())."""
        if self._loop is None:
            raise RuntimeError("HistoryStore.start() must run before token_history()")
        return TokenHistory(self, timeout)


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
