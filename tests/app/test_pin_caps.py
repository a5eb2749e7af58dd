"""Per-owner pin caps shared by replicas through a real Redis (app/pin_caps.py): two
replicas' pins count against one cap together, even reserved at once; with Redis down
(a dead server, a wrong port) each replica counts its own pins alone, says so once, loses
no request, and writes its pins back when Redis returns."""

from __future__ import annotations

import asyncio
import logging

from app import pin_caps
from app.pin_caps import PinCaps

MB = 2**20


async def test_two_replicas_share_an_owners_cap(redis_url):
    a, b = PinCaps(redis_url), PinCaps(redis_url)
    assert await a.reserve("o", "c1", 3 * MB, 60, 4 * MB) is None
    assert await b.reserve("o", "c2", 2 * MB, 60, 4 * MB) == 3 * MB  # refused: a's 3 MB
    assert await b.reserve("o", "c2", 1 * MB, 60, 4 * MB) is None
    assert await a.reserve("o", "c1", 3 * MB, 60, 4 * MB) is None  # its own pin, renewed
    assert await b.reserve("someone else", "c3", 4 * MB, 60, 4 * MB) is None  # per owner
    await a.hold("o", "c1", 1 * MB, a.now() + 60)  # its turn ended holding less
    assert await b.reserve("o", "c4", 2 * MB, 60, 4 * MB) is None
    await b.forget("o", "c2")
    await b.forget("o", "c4")
    assert await a.reserve("o", "c5", 3 * MB, 60, 4 * MB) is None
    assert a.healthy and b.healthy
    await a.close()
    await b.close()


async def test_reservations_at_once_cannot_pass_the_cap_together(redis_url):
    replicas = [PinCaps(redis_url) for _ in range(2)]
    tries = [replicas[i % 2].reserve("o", f"c{i}", MB, 60, 3 * MB) for i in range(10)]
    results = await asyncio.gather(*tries)
    assert sum(r is None for r in results) == 3
    for r in replicas:
        await r.close()


async def test_expired_pins_count_no_more(redis_url):
    clock = [1000.0]
    a, b = PinCaps(redis_url, now=lambda: clock[0]), PinCaps(redis_url, now=lambda: clock[0])
    assert await a.reserve("o", "c1", 3 * MB, 10, 4 * MB) is None
    assert await b.reserve("o", "c2", 3 * MB, 10, 4 * MB) is not None
    clock[0] += 11  # a's pin ran out
    assert await b.reserve("o", "c2", 3 * MB, 10, 4 * MB) is None


async def test_a_dead_redis_falls_back_to_per_replica_counts(redis_server, caplog, monkeypatch):
    monkeypatch.setattr(pin_caps, "RETRY_S", 0.0)  # try Redis again at every call
    a, b = PinCaps(redis_server.url), PinCaps(redis_server.url)
    assert await a.reserve("o", "c1", 3 * MB, 60, 4 * MB) is None
    redis_server.kill()
    with caplog.at_level(logging.WARNING, logger="app.pin_caps"):
        # each replica counts its own pins alone: b passes, a does not
        assert await b.reserve("o", "c2", 3 * MB, 60, 4 * MB) is None
        assert await b.reserve("o", "c3", 2 * MB, 60, 4 * MB) == 3 * MB
        assert await a.reserve("o", "c4", 2 * MB, 60, 4 * MB) == 3 * MB
        await a.forget("o", "c1")  # no request lost or raised while Redis is down
        assert await a.reserve("o", "c4", 2 * MB, 60, 4 * MB) is None
    assert not a.healthy and not b.healthy
    downs = [r for r in caplog.records if "Redis is down" in r.getMessage()]
    assert len(downs) == 2  # once a replica, not once a call
    redis_server.start()  # a fresh Redis: it lost every pin
    with caplog.at_level(logging.WARNING, logger="app.pin_caps"):
        assert await b.reserve("o", "c5", MB, 60, 8 * MB) is None  # b writes its pins back
        assert await a.reserve("o", "c6", MB, 60, 8 * MB) is None  # and a its own
    assert a.healthy and any("back" in r.getMessage() for r in caplog.records)
    # b's 3 + 1 MB and a's 2 + 1 MB are shared again: 7 MB of 8
    assert await PinCaps(redis_server.url).reserve("o", "c7", 2 * MB, 60, 8 * MB) == 7 * MB


async def test_a_wrong_port_counts_per_replica_and_says_so(caplog):
    caps = PinCaps("redis://127.0.0.1:1/0")
    with caplog.at_level(logging.WARNING, logger="app.pin_caps"):
        assert await caps.reserve("o", "c1", 3 * MB, 60, 4 * MB) is None
        assert await caps.reserve("o", "c2", 3 * MB, 60, 4 * MB) == 3 * MB
        await caps.hold("o", "c1", MB, caps.now() + 60)
        assert await caps.reserve("o", "c2", 3 * MB, 60, 4 * MB) is None
    assert sum("Redis is down" in r.getMessage() for r in caplog.records) == 1
    await caps.close()


async def test_without_redis_a_replica_counts_alone():
    caps = PinCaps(None)
    assert await caps.reserve("o", "c1", 3 * MB, 60, 4 * MB) is None
    assert await caps.reserve("o", "c2", 3 * MB, 60, 4 * MB) == 3 * MB
    await caps.forget("o", "c1")
    assert await caps.reserve("o", "c2", 3 * MB, 60, 4 * MB) is None
