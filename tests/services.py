"""A PostgreSQL database of a test's own on the machine's PostgreSQL (bench/lib/harness.py starts
it when it is not running)."""

from __future__ import annotations

import shutil
import subprocess
import uuid

from bench.lib.harness import PG_HOST, PG_PORT, PG_USER, ServiceError, ensure_postgres


def psql(sql: str, database: str = "postgres") -> str:
    """Run one SQL statement as the postgres user over TCP; returns psql's output."""
    if shutil.which("psql") is None:
        raise ServiceError("psql is not installed")
    cmd = ["psql", "-h", PG_HOST, "-p", str(PG_PORT), "-U", PG_USER, "-d", database]
    cmd += ["-v", "ON_ERROR_STOP=1", "-Atqc", sql]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        raise ServiceError(f"psql {sql!r} failed: {res.stderr.strip()}")
    return res.stdout


def create_database(prefix: str = "pensieve_test") -> str:
    """A new empty PostgreSQL database; returns its name."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    psql(f'CREATE DATABASE "{name}"')
    return name


def drop_database(name: str) -> None:
    psql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def pg_async_url(name: str) -> str:
    return f"postgresql+asyncpg://{PG_USER}@{PG_HOST}:{PG_PORT}/{name}"


def new_database() -> tuple[str, str]:
    """A new database, PostgreSQL started first if need be: its name and asyncpg URL."""
    ensure_postgres()
    name = create_database()
    return name, pg_async_url(name)
