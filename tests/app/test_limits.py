"""Quotas a minute shared by replicas through a real Redis (app/limits.py): two servers'
quotas count one owner's turns together; with Redis down each counts alone (and says so
once), and shares again when it is back."""

from __future__ import annotations

import logging

from app import limits
from app.limits import Quotas, retry_after


async def test_two_replicas_share_an_owners_quota(redis_url):
    a, b = Quotas(redis_url), Quotas(redis_url)
    assert await a.take("turns", "owner", 3) is None
    assert await b.take("turns", "owner", 3) is None
    assert await a.take("turns", "owner", 3) is None
    wait = await b.take("turns", "owner", 3)  # the fourth, on either replica: refused
    assert wait is not None and 55 < wait <= 60 and retry_after(wait) == "60"
    assert await a.take("turns", "owner", 3) is not None
    assert await a.take("turns", "someone else", 3) is None  # per key
    assert await a.take("new-users", "owner", 3) is None  # and per kind
    assert a.healthy and b.healthy


async def test_a_dead_redis_falls_back_to_per_replica_counts(redis_server, caplog, monkeypatch):
    monkeypatch.setattr(limits, "RETRY_S", 0.0)  # try Redis again at every take
    a, b = Quotas(redis_server.url), Quotas(redis_server.url)
    assert await a.take("turns", "o", 2) is None and await b.take("turns", "o", 2) is None
    assert await a.take("turns", "o", 2) is not None  # shared: spent
    redis_server.kill()
    with caplog.at_level(logging.WARNING, logger="app.limits"):
        for _ in range(2):  # each replica counts alone: 2 more each, the third refused
            assert await a.take("turns", "o", 2) is None
        assert await a.take("turns", "o", 2) is not None
        assert await b.take("turns", "o", 2) is None
    assert not a.healthy
    downs = [r for r in caplog.records if "Redis is down" in r.getMessage()]
    assert len(downs) == 2  # once a replica, not once a take
    redis_server.start()
    with caplog.at_level(logging.WARNING, logger="app.limits"):
        assert await a.take("turns", "fresh", 1) is None
    assert a.healthy and any("back" in r.getMessage() for r in caplog.records)
    assert await b.take("turns", "fresh", 1) is not None  # shared again


async def test_without_redis_a_replica_counts_alone():
    q = Quotas(None)
    assert await q.take("turns", "o", 1) is None
    assert 55 < await q.take("turns", "o", 1) <= 60
