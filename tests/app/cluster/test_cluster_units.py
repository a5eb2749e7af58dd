"""The replica directory on a real Redis, the HAProxy config checked by haproxy itself, the
forward mark, and `pensieve cluster` started and stopped for real."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import httpx
import pytest

from app.cluster import haproxy
from app.cluster.directory import Directory
from app.cluster.handoff import FORWARDED, _accept_forwarded, conversation_in
from app.cluster.launcher import START_TRIES, Launcher, Replica
from app.cluster.replica import forward_key
from bench.lib import harness
from store.migrate import upgrade_async
from tests import services
from tests.app_fixtures import ADMIN


@pytest.fixture
def redis_url():
    rs = services.RedisServer().start()
    try:
        yield rs.url
    finally:
        rs.kill()


async def test_claims_are_exclusive_and_pass_on_when_the_home_dies(redis_url):
    a = Directory(redis_url, "a", alive_ttl_s=0.4)
    b = Directory(redis_url, "b", alive_ttl_s=0.4)
    try:
        await a.heartbeat(1.0, {"url": "http://a"})
        await b.heartbeat(2.0, {"url": "http://b"})
        first = await a.claim("c1")
        assert (first.replica, first.previous) == ("a", "")
        # Concurrent claims of one new chat: exactly one wins, the other is told who.
        both = await asyncio.gather(a.claim("c2"), b.claim("c2"))
        assert {h.replica for h in both} == {await a.home("c2")}
        seen = await b.claim("c1")
        assert (seen.replica, seen.url, seen.started) == ("a", "http://a", "1.0")
        assert await a.home("c1") == "a"
        # b found a unreachable: it takes c1 over at once, a learns it on its next refresh.
        taken = await b.claim("c1", dead="a")
        assert (taken.replica, taken.previous) == ("b", "a")
        assert await a.refresh(["c1", "c3"]) == ["c1"]
        assert await a.home("c3") == "a"  # a vanished key of a's is set again
        # a's heartbeat lapses: its other chats go to whoever asks next.
        await asyncio.sleep(0.6)
        await b.heartbeat(2.0, {"url": "http://b"})
        moved = await b.claim("c3")
        assert (moved.replica, moved.previous) == ("b", "a")
        listed = {r["id"]: r for r in await b.replicas()}
        assert listed["a"]["alive"] is False and listed["b"]["alive"] is True
        assert listed["b"]["url"] == "http://b"
        # A restarted a (new `started`) is alive again; release gives up only its own homes.
        await a.heartbeat(3.0, {"url": "http://a"})
        assert (await b.claim("c2")).replica in ("a", "b")
        assert await a.release(["c1", "c3"]) == 0
        assert await b.release(["c1"]) == 1 and await b.home("c1") is None
        await a.leave()
        assert {r["id"]: r["alive"] for r in await b.replicas()}["a"] is False
    finally:
        await a.close()
        await b.close()


def test_haproxy_accepts_the_config_and_hashes_on_the_conversation(tmp_path):
    backends = [haproxy.Backend(haproxy.backend_name(f"10.0.0.{i}:8000"), f"10.0.0.{i}:8000")
                for i in (1, 2, 3)]  # fmt: skip
    text = haproxy.config(backends, "127.0.0.1:8080")
    path = tmp_path / "haproxy.cfg"
    path.write_text(text)
    haproxy.check(str(path))  # haproxy -c: raises with its message on a bad config
    assert "balance hash var(txn.chat)" in text and "hash-type consistent" in text
    assert "option httpchk GET /healthz" in text and "timeout tunnel" in text
    path.write_text(text.replace("balance hash", "balance nonsense"))
    with pytest.raises(ValueError, match="haproxy refused"):
        haproxy.check(str(path))


def test_paths_that_name_a_conversation():
    assert conversation_in("/ws/chat/abc") == "abc"
    assert conversation_in("/api/conversations/abc") == "abc"
    assert conversation_in("/api/conversations/abc/messages") == "abc"
    assert conversation_in("/api/conversations") is None
    assert conversation_in("/v1/chat/completions") is None


def test_only_a_replica_can_mark_a_request_forwarded():
    key = forward_key("secret")
    base = {"type": "http", "path": "/ws/chat/x", "headers": [(b"host", b"replica:8001")]}

    def scope(mark: str) -> dict:
        extra = [(FORWARDED.encode(), mark.encode()), (b"x-pensieve-host", b"front:80")]
        return {**base, "headers": base["headers"] + extra}

    forged = _accept_forwarded(scope("0" * 64), key)
    assert "forwarded" not in forged.get("state", {})
    assert dict(forged["headers"]) == {b"host": b"replica:8001"}  # marks removed, host kept
    real = _accept_forwarded(scope(key), key)
    assert real["state"]["forwarded"] is True
    assert dict(real["headers"]) == {b"host": b"front:80"}  # judged as the client sent it
    assert forward_key("other") != key


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_pensieve_cluster_starts_replicas_and_haproxy_and_stops_them(tmp_path):
    db, url = services.new_database()
    cluster = services.LocalCluster(
        url,
        tmp_path / "cluster.log",
        env={"PENSIEVE_DEVICE": "cpu"},
        args=["--model", "dummy:tiny", "--gpu-cache-chunks", "16", "--cpu-cache-chunks", "16"],
        admin_token=ADMIN,
        replicas=2,
    )
    try:
        cluster.start(timeout=300)
        listing = cluster.listing()
        pids = [r["pid"] for r in listing["replicas"]]
        ports = sorted(int(r["id"].rsplit(":", 1)[1]) for r in listing["replicas"])
        assert ports == [cluster.port + 1, cluster.port + 2]
        cluster.proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert cluster.proc.wait(60) == 0
        for pid in pids:  # every replica is gone, and the front with them
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{cluster.url}/healthz")
    finally:
        cluster.kill()
        services.drop_database(db)


def test_a_replica_whose_port_was_taken_starts_on_another_and_a_failing_one_is_left_out(tmp_path):
    """The race of `pensieve cluster`: a replica's port found free, then bound by another
    process before the replica binds it. The launcher starts that replica again on another
    port; a replica that fails every start is left out, and the others go on."""
    db, url = services.new_database()
    asyncio.run(upgrade_async(url))  # as `pensieve cluster` does before its replicas start
    rs = services.RedisServer().start()
    host = "127.0.0.1"
    thief = socket.socket()
    thief.bind((host, 0))
    thief.listen()
    taken = thief.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PENSIEVE_")}
    env.update(
        PENSIEVE_DATABASE_URL=url, PENSIEVE_REDIS_URL=rs.url, PENSIEVE_CLUSTER="true",
        PENSIEVE_ADMIN_TOKEN=ADMIN, PENSIEVE_MODEL="dummy:tiny", PENSIEVE_DEVICE="cpu",
        PENSIEVE_GPU_CACHE_CHUNKS="16", PENSIEVE_CPU_CACHE_CHUNKS="16",
    )  # fmt: skip
    broken = {**env, "PENSIEVE_MAX_BATCH_TOKENS": "0"}  # refused at start, every time
    moved = Replica(host, taken, env, "warning")
    failing = Replica(host, harness.free_port(), broken, "warning")
    front = harness.free_port()
    launcher = Launcher([moved, failing], f"{host}:{front}", tmp_path)
    try:
        launcher.start()
        assert launcher.replicas == [moved]
        assert moved.port != taken and moved.tries == 1
        # up (the launcher saw it healthy); a loaded machine may take over a second to answer
        assert any(moved.healthy() or time.sleep(0.5) for _ in range(20))
        assert failing.tries == START_TRIES and failing.proc.poll() is not None
        for _ in range(100):  # HAProxy's first health check
            try:
                if httpx.get(f"http://{host}:{front}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert httpx.get(f"http://{host}:{front}/healthz", timeout=1).status_code == 200
    finally:
        launcher.stop()
        thief.close()
        rs.kill()
        services.drop_database(db)
