"""Redis activity times drive the engine's eviction; a dead Redis degrades health only."""

from __future__ import annotations

import time

import httpx
import pytest
import redis

from tests import services
from tests.app_fixtures import Server, connect, say, wait_for

pytestmark = pytest.mark.timeout(300)

KEY = "pensieve:activity"  # the RedisClock's sorted set: conversation id -> unix time


@pytest.fixture(scope="module")
def redis_server():
    server = services.RedisServer().start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def server(redis_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("redis")
    env = {
        "PENSIEVE_REDIS_URL": redis_server.url,
        "PENSIEVE_GPU_CACHE_CHUNKS": "10",
        "PENSIEVE_CPU_CACHE_CHUNKS": "40",
    }
    srv = Server(f"sqlite+aiosqlite:///{tmp}/pensieve.db", tmp / "server.log", env=env).start()
    yield srv
    srv.stop()


def tiers(server, cid) -> list[str]:
    conv = [c for c in server.cache()["conversations"] if c["id"] == cid]
    return conv[0]["chunks"] if conv else []


async def test_redis_idle_time_decides_who_is_evicted(server, redis_server):
    token = server.user("redis")
    a, b = server.new_chat(token), server.new_chat(token)
    for cid in (a, b):
        async with connect(server, cid, token) as ws:
            await say(ws, "Name three colours of the rainbow.", max_tokens=24)
    assert all(t == "gpu" for t in tiers(server, a) + tiers(server, b))
    # By the server's own clock `a` is the older one; Redis says `b` has been idle an hour.
    r = redis.Redis.from_url(redis_server.url)

    def b_idle():
        # Written again until seen: the server's own last touches may still be on their way.
        now = time.time()
        r.zadd(KEY, {a: now, b: now - 3600})
        conv = [c for c in server.cache()["conversations"] if c["id"] == b]
        return conv and conv[0]["idle_s"] is not None and conv[0]["idle_s"] > 3000

    assert wait_for(b_idle, timeout=10, every=0.3), "the engine did not see Redis's activity time"
    # Fill the small GPU tier with another chat: `b` gives way before `a`.
    c = server.new_chat(token)
    async with connect(server, c, token) as ws:
        for _ in range(6):
            await say(ws, "Tell me one more fact about rainbows.", max_tokens=24)
            if "gpu" not in tiers(server, b) or any(t != "gpu" for t in tiers(server, a)):
                break
    ta, tb = tiers(server, a), tiers(server, b)
    assert tb.count("gpu") < len(tb), f"b kept all its chunks on the GPU: {tb}"
    assert ta.count("gpu") >= tb.count("gpu"), (ta, tb)


async def test_dead_redis_degrades_health_and_serving_goes_on(server, redis_server):
    assert httpx.get(server.url + "/healthz").json()["status"] == "ok"
    redis_server.kill()
    try:

        def degraded():
            body = httpx.get(server.url + "/healthz").json()
            return body if body["status"] == "degraded" else None

        body = wait_for(degraded, timeout=10)
        assert body, "health did not notice Redis is gone"
        assert body["checks"]["redis"]["status"] == "down"
        token = server.user("no-redis")
        cid = server.new_chat(token)
        async with connect(server, cid, token) as ws:
            r1 = await say(ws, "Hello!", max_tokens=8)
            r2 = await say(ws, "How are you?", max_tokens=8)
        assert r1.errors == [] and r2.errors == []
        assert r2.done["usage"]["cached_tokens"] > 0
    finally:
        redis_server.start()
    assert wait_for(lambda: httpx.get(server.url + "/healthz").json()["status"] == "ok", timeout=15)
