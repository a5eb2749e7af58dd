"""RedisClock against real Redis servers, including one that dies and comes back."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import pytest
import redis

from store import RedisClock
from store.activity import KEY


async def _until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_touch_reaches_redis_and_redis_reaches_the_clock(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    clock = RedisClock(redis_url, interval=0.05)
    await clock.start()
    try:
        assert clock.healthy and clock.last_error is None
        clock.touch("a", 1000.5)
        assert clock.last_active("a") == 1000.5  # at once, before any sync
        before = time.time()
        clock.touch("b")
        assert before <= clock.last_active("b") <= time.time()
        await _until(lambda: r.zscore(KEY, "a") == 1000.5)
        assert r.zscore(KEY, "b") == clock.last_active("b")

        # Times written by anyone else (another server, an operator) reach the engine.
        r.zadd(KEY, {"c": 42.0, "a": 7.0})
        await _until(lambda: clock.last_active("c") == 42.0 and clock.last_active("a") == 7.0)
        r.zrem(KEY, "c")
        await _until(lambda: clock.last_active("c") is None)

        clock.forget("b")
        assert clock.last_active("b") is None
        await _until(lambda: r.zscore(KEY, "b") is None)
        assert clock.last_active("unknown") is None
    finally:
        await clock.stop()
        r.close()


async def test_stop_flushes_pending_touches(redis_url: str) -> None:
    clock = RedisClock(redis_url, interval=60)
    await clock.start()
    clock.touch("late", 5.0)
    await clock.stop()
    assert redis.Redis.from_url(redis_url).zscore(KEY, "late") == 5.0


async def test_dead_redis_keeps_local_times_and_recovers(redis_server, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="store.activity")
    clock = RedisClock(redis_server.url, interval=0.05, timeout=0.2)
    await clock.start()
    try:
        clock.touch("a", 100.0)
        await clock.sync()
        assert clock.healthy

        redis_server.kill()
        await _until(lambda: not clock.healthy)
        assert clock.last_error
        t0 = time.perf_counter()
        clock.touch("b", 200.0)  # served locally, without waiting on the dead server
        assert clock.last_active("a") == 100.0
        assert clock.last_active("b") == 200.0
        assert time.perf_counter() - t0 < 0.01
        await asyncio.sleep(0.3)  # several failed retries: still one log line
        assert clock.last_active("a") == 100.0
        downs = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(downs) == 1

        redis_server.start()  # same port, empty: it lost everything
        await _until(lambda: clock.healthy)
        assert clock.last_error is None
        r = redis.Redis.from_url(redis_server.url)
        await _until(lambda: r.zscore(KEY, "a") == 100.0 and r.zscore(KEY, "b") == 200.0)
        assert clock.last_active("a") == 100.0
        ups = [r for r in caplog.records if "reachable again" in r.getMessage()]
        assert len(ups) == 1
        r.close()
    finally:
        await clock.stop()


async def test_unreachable_at_start_serves_locally(redis_server) -> None:
    url = redis_server.url
    redis_server.kill()
    clock = RedisClock(url, interval=0.05, timeout=0.2)
    await clock.start()
    try:
        assert not clock.healthy and clock.last_error
        clock.touch("x", 3.0)
        assert clock.last_active("x") == 3.0
        redis_server.start()
        await _until(lambda: clock.healthy)
        assert redis.Redis.from_url(url).zscore(KEY, "x") == 3.0
    finally:
        await clock.stop()


@pytest.mark.parametrize("url", ["http://localhost", "not a url"])
def test_bad_redis_url_is_refused(url: str) -> None:
    with pytest.raises(ValueError):
        RedisClock(url)


async def test_hung_redis_never_blocks_the_caller(redis_server) -> None:
    clock = RedisClock(redis_server.url, interval=0.05, timeout=0.3)
    await clock.start()
    try:
        clock.touch("a", 1.0)
        await clock.sync()
        redis_server.pause()  # accepts nothing, answers nothing
        worst = 0.0
        deadline = time.monotonic() + 3
        while clock.healthy:  # each touch and read returns at once while the sync hangs
            t0 = time.perf_counter()
            clock.touch("b", 2.0)
            assert clock.last_active("a") == 1.0
            worst = max(worst, time.perf_counter() - t0)
            assert time.monotonic() < deadline, "a hung Redis was never noticed"
            await asyncio.sleep(0.01)
        assert worst < 0.01
        assert "Timeout" in (clock.last_error or "")
        redis_server.resume()
        await _until(lambda: clock.healthy)
        assert redis.Redis.from_url(redis_server.url).zscore(KEY, "b") == 2.0
    finally:
        redis_server.resume()
        await clock.stop()


async def test_touch_during_a_refresh_is_not_lost(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    clock = RedisClock(redis_url, interval=60)  # syncs only when asked
    await clock.start()
    try:
        r.zadd(KEY, {"x": 1.0})
        flight = asyncio.create_task(clock.sync())
        await asyncio.sleep(0)  # the sync has sent its request and awaits the answer
        clock.touch("x", 9.0)
        assert await flight
        assert r.zscore(KEY, "x") == 1.0  # the touch came after the request left
        assert clock.last_active("x") == 9.0  # and the older Redis answer did not undo it
        await clock.sync()
        assert r.zscore(KEY, "x") == 9.0
    finally:
        await clock.stop()
        r.close()


def test_touch_refuses_times_redis_would_reject() -> None:
    clock = RedisClock("redis://127.0.0.1:1/0")
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite"):
            clock.touch("a", bad)
    assert clock.last_active("a") is None
