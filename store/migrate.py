"""Bring a database's schema to a revision with Alembic (the only way the schema changes)."""

from __future__ import annotations

import asyncio
import importlib.util
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy.pool import NullPool

from store.db import database_url, make_engine, prepare_url

T = TypeVar("T")

SOURCE_ROOT = Path(__file__).resolve().parent.parent


def scripts_dir() -> Path:
    """The migration scripts: alembic/ of a source checkout, else the copy installed as the
    `pensieve_migrations` package (see pyproject.toml)."""
    if (SOURCE_ROOT / "pyproject.toml").is_file():
        return SOURCE_ROOT / "alembic"
    # A namespace package: its path may also hold an editable install's hook entry, so
    # take the first real directory that has the files.
    spec = importlib.util.find_spec("pensieve_migrations")
    for entry in spec.submodule_search_locations if spec else []:
        if (Path(entry) / "env.py").is_file():
            return Path(entry)
    raise RuntimeError("pensieve_migrations is not installed: reinstall pensieve")


def config(url: str | None = None) -> Config:
    """Alembic config for `url` (default: PENSIEVE_DATABASE_URL), without touching logging."""
    scripts = scripts_dir()
    if not (scripts / "env.py").is_file():
        raise RuntimeError(f"migration scripts not found under {scripts}")
    cfg = Config()
    cfg.set_main_option("script_location", str(scripts))
    cfg.set_main_option("path_separator", "os")
    url = url or database_url()
    prepare_url(url)  # clear error for a bad URL, and the SQLite directory
    cfg.attributes["url"] = url
    cfg.attributes["quiet_logging"] = True
    return cfg


# Alembic keeps its running context in module globals: one migration per process at a time.
_alembic_lock = threading.Lock()


def _in_thread(fn: Callable[..., T], *args: Any) -> T:
    # env.py runs its own event loop (asyncio.run), which cannot nest in a running loop:
    # give it a thread of its own, and re-raise its error here.
    out: list[Any] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            with _alembic_lock:
                out.append(fn(*args))
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)

    t = threading.Thread(target=target, name="alembic", daemon=True)
    t.start()
    t.join()
    if errors:
        raise errors[0]
    return out[0]


def upgrade(url: str | None = None, revision: str = "head") -> None:
    """Upgrade the schema; safe to call from inside a running event loop (blocks it)."""
    _in_thread(command.upgrade, config(url), revision)


def downgrade(url: str | None = None, revision: str = "base") -> None:
    _in_thread(command.downgrade, config(url), revision)


async def upgrade_async(url: str | None = None, revision: str = "head") -> None:
    """Upgrade without blocking the running loop."""
    await asyncio.to_thread(upgrade, url, revision)


def current(url: str | None = None) -> str | None:
    """The database's current revision (None when unversioned)."""

    async def read() -> str | None:
        engine = make_engine(url or database_url(), poolclass=NullPool)
        try:
            async with engine.connect() as conn:
                return await conn.run_sync(
                    lambda c: MigrationContext.configure(c).get_current_revision()
                )
        finally:
            await engine.dispose()

    return _in_thread(asyncio.run, read())
