"""Shared fixtures: real PostgreSQL, SQLite and Redis, started when not running."""

from __future__ import annotations

import itertools
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench.lib import harness
from tests import services


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """`pytest -m gpu` imports only the test files that hold GPU tests: a lent GPU machine
    has no web stack, which the other files import. (tests/bench/test_bare_gpu.py checks that this
    collects the same GPU tests as a full collection does.)"""
    if not _gpu_selected(config) or not collection_path.name.startswith("test_"):
        return None
    if collection_path.suffix != ".py":
        return None
    return re.search(r"\bmark\.gpu\b|@gpu\b|tests\.devices", collection_path.read_text()) is None


# The files that take longest on 2 cores (from 20 s to minutes, longest first), taken first.
# `make test` hands whole files to its two workers (--dist loadfile) in collection order
# (--no-loadscope-reorder): one of these taken last keeps one worker busy after the other
# has finished. xdist's own order (most tests first) put test_packaging.py's one test last.
SLOW_FILES = (
    "tests/engine/model/test_model_families.py",
    "tests/engine/test_engine_equality.py",
    "tests/engine/model/test_int4.py",
    "tests/bench/test_bare_gpu.py",
    "tests/engine/test_compiled.py",
    "tests/app/test_dynamo_worker.py",
    "tests/test_packaging.py",
    "tests/app/cluster/test_cluster_dynamo.py",
    "tests/app/cluster/test_cluster_routers.py",
    "tests/app/test_app_restart.py",
    "tests/app/cluster/test_cluster_disk.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow files first, then the others by their number of tests (most first, as xdist
    orders them itself); each file's tests stay together and in their order."""
    first = {name: i for i, name in enumerate(SLOW_FILES)}
    files = Counter(item.nodeid.split("::", 1)[0] for item in items)

    def rank(item: pytest.Item) -> tuple[int, int]:
        name = item.nodeid.split("::", 1)[0]
        return first.get(name, len(first)), -files[name]

    items.sort(key=rank)  # stable: a file's tests keep their order


def _gpu_selected(config: pytest.Config) -> bool:
    """Does the -m expression select the gpu marker (and not only exclude it)?"""
    return re.search(r"(?<!not )\bgpu\b", config.getoption("markexpr") or "") is not None


def _own_redis_dbs() -> list[int]:
    """Redis databases 1..15 (0 is left alone), split between pytest-xdist workers when the
    suite runs on several: a test's keys never meet another's, here or on another worker."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return [db for db in range(1, 16) if (db - 1) % workers == worker]


# Taken in turn, each flushed before and after its test.
_redis_dbs = itertools.cycle(_own_redis_dbs())


def _service(start: Callable[[], None]) -> None:
    try:
        start()
    except harness.ServiceError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session")
def postgres() -> None:
    _service(services.ensure_postgres)


@pytest.fixture(scope="session")
def redis_service() -> None:
    _service(services.ensure_redis)


@pytest.fixture
def pg_url(postgres: None) -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test (asyncpg URL); dropped afterwards."""
    try:
        name = services.create_database()
    except harness.ServiceError as e:
        pytest.fail(str(e), pytrace=False)
    yield services.pg_async_url(name)
    services.drop_database(name)


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path}/pensieve.db"


@pytest.fixture
def redis_url(redis_service: None) -> Iterator[str]:
    """The shared Redis, on a database number of this test's own, flushed before and after."""
    import redis

    db = next(_redis_dbs)
    url = f"redis://{services.REDIS_HOST}:{services.REDIS_PORT}/{db}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield url
    client.flushdb()
    client.close()


@pytest.fixture
def redis_server() -> Iterator[services.RedisServer]:
    """A redis-server of this test's own on a free port; the test may kill() and start() it."""
    server = services.RedisServer()
    try:
        server.start()
    except harness.ServiceError as e:
        pytest.fail(str(e), pytrace=False)
    yield server
    server.kill()
