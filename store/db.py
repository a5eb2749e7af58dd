"""Database URLs and async engines (SQLite via aiosqlite, PostgreSQL via asyncpg)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

DEFAULT_URL = "sqlite+aiosqlite:///./data/pensieve.db"
ASYNC_DRIVERS = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+asyncpg"}
SQLITE_BUSY_MS = 10_000
DEFAULT_TIMEOUT_S = 5.0


def database_url() -> str:
    """The configured URL: PENSIEVE_DATABASE_URL, else a SQLite file under ./data."""
    return os.environ.get("PENSIEVE_DATABASE_URL") or DEFAULT_URL


def parse_url(url: str | URL) -> URL:
    """Parse and check a URL, mapping plain `sqlite:`/`postgresql:` to their async drivers."""
    try:
        parsed = make_url(url)
    except ArgumentError as e:
        raise ValueError(f"invalid database URL {str(url)!r}: {e}") from None
    backend = parsed.get_backend_name()
    if backend not in ASYNC_DRIVERS:
        raise ValueError(
            f"unsupported database {backend!r} in {parsed.render_as_string(hide_password=True)}; "
            "use sqlite+aiosqlite:///path.db or postgresql+asyncpg://user@host/db"
        )
    driver = ASYNC_DRIVERS[backend]
    if parsed.drivername not in (backend, driver):
        raise ValueError(
            f"driver {parsed.drivername!r} is not async; use {driver!r} for {backend} databases"
        )
    return parsed.set(drivername=driver)


def is_sqlite(url: str | URL) -> bool:
    return parse_url(url).get_backend_name() == "sqlite"


def prepare_url(url: str | URL) -> URL:
    """parse_url, and create the directory of a SQLite file so that it can be opened."""
    parsed = parse_url(url)
    if parsed.get_backend_name() == "sqlite":
        db = parsed.database
        if not db or db == ":memory:" or db.startswith("file:"):
            raise ValueError(
                "an in-memory SQLite database cannot be shared between connections; "
                "give a file path, e.g. sqlite+aiosqlite:///./data/pensieve.db"
            )
        Path(db).expanduser().parent.mkdir(parents=True, exist_ok=True)
    return parsed


def _enter_wal(cur: Any) -> None:
    # WAL lets readers run while one writer commits. Switching a fresh database into WAL
    # answers "database is locked" at once, without the busy handler, while another
    # process holds it (servers starting together): wait and retry as the handler would.
    deadline = time.monotonic() + SQLITE_BUSY_MS / 1000
    while True:
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except Exception as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    # The busy timeout makes writers queue.
    cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_MS}")
    _enter_wal(cur)
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def make_engine(
    url: str | URL, timeout_s: float | None = DEFAULT_TIMEOUT_S, **kwargs: Any
) -> AsyncEngine:
    """An async engine with the per-backend settings the store relies on.

    On PostgreSQL, `timeout_s` bounds connecting, each statement and waiting for a pooled
    connection, so an unreachable server fails operations instead of hanging them (None:
    statements unbounded, for migrations). SQLite keeps its busy timeout.
    """
    parsed = prepare_url(url)
    if parsed.get_backend_name() == "sqlite":
        kwargs.setdefault("connect_args", {"timeout": SQLITE_BUSY_MS / 1000})
        engine = create_async_engine(parsed, **kwargs)
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    connect_timeout = timeout_s or DEFAULT_TIMEOUT_S
    kwargs.setdefault("connect_args", {"timeout": connect_timeout, "command_timeout": timeout_s})
    if "poolclass" not in kwargs:
        kwargs.setdefault("pool_timeout", connect_timeout)
    return create_async_engine(parsed, **kwargs)


def _reason(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return "no answer (timed out)"
    text = str(getattr(e, "orig", None) or e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


async def check_database(url: str | URL, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Raise ConnectionError (one line, no password) unless the database answers in time."""
    from sqlalchemy import text
    from sqlalchemy.pool import NullPool

    engine = make_engine(url, timeout_s=timeout_s, poolclass=NullPool)
    try:
        async with asyncio.timeout(timeout_s):
            async with engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
    except Exception as e:
        where = engine.url.render_as_string(hide_password=True)
        raise ConnectionError(f"cannot reach the database at {where}: {_reason(e)}") from None
    finally:
        await engine.dispose()
