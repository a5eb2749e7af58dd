"""Alembic environment: runs migrations through an async engine (aiosqlite or asyncpg)."""

import asyncio
import fcntl
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from logging.config import fileConfig
from pathlib import Path

from alembic import context
from sqlalchemy import pool, text
from sqlalchemy.engine import Connection

from store.db import database_url, make_engine
from store.models import Base

config = context.config
# Called from the server (store.migrate), the server's logging stays as it is.
if config.config_file_name is not None and not config.attributes.get("quiet_logging"):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def url() -> str:
    return config.attributes.get("url") or database_url()


def run_migrations_offline() -> None:
    context.configure(
        url=url(),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


# Any fixed number: servers starting together on one PostgreSQL database take turns.
MIGRATION_LOCK = 0x70656E73


@contextmanager
def sqlite_lock(connection: Connection) -> Iterator[None]:
    # SQLite DDL runs outside a transaction here: a lock file beside the database
    # makes processes that start together migrate one after the other.
    path = Path(connection.engine.url.database or "").with_suffix(".migrate-lock")
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def do_run_migrations(connection: Connection) -> None:
    # Batch mode lets later ALTERs work on SQLite (table copy).
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    sqlite = connection.dialect.name == "sqlite"
    with sqlite_lock(connection) if sqlite else nullcontext(), context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Held until commit; the current revision is read after it is granted.
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
        context.run_migrations()


async def run_async_migrations() -> None:
    # Migrations may wait for another server's lock or run long: no statement bound.
    engine = make_engine(url(), timeout_s=None, poolclass=pool.NullPool)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(do_run_migrations)
    finally:
        await engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    asyncio.run(run_async_migrations())
