"""Three replicas behind HAProxy on PostgreSQL and Redis, all real processes: chats spread
over replicas and stay where their cache is, hand-off to the home, one live socket per chat
across replicas, failover by recompute from SQL after a SIGKILL, and a restarted replica
rejoining."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
import websockets

from app.cluster.replica import ALIVE_TTL_S, HEARTBEAT_S, replica_id
from tests.app_fixtures import ADMIN, auth, connect, recv, say
from tests.cluster_fixtures import Cluster, start_cluster

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def token(cluster: Cluster) -> str:
    return cluster.servers[0].user("cluster-owner")


def new_chat(base: str, token: str) -> str:
    r = httpx.post(base + "/api/conversations", json={}, headers=auth(token))
    assert r.status_code == 201, r.text
    return r.json()["id"]


def messages(base: str, token: str, cid: str) -> list[tuple[str, str, str | None]]:
    r = httpx.get(f"{base}/api/conversations/{cid}", headers=auth(token))
    assert r.status_code == 200, r.text
    return [(m["role"], m["content"], m["finish_reason"]) for m in r.json()["messages"]]


def held_by(cluster: Cluster) -> dict[str, set[str]]:
    """Replica id -> conversations its engine holds, as /api/admin/cluster lists them (after
    a heartbeat, which carries each replica's report)."""
    time.sleep(HEARTBEAT_S * 1.5)
    listing = cluster.listing()
    return {r["id"]: {c["id"] for c in r.get("held", [])} for r in listing["replicas"]}


async def two_turns(cluster: Cluster, token: str, cid: str) -> tuple[dict, dict]:
    async with connect(cluster.front, cid, token) as ws:
        first = await say(ws, "Hello there, who are you?", max_tokens=6)
        second = await say(ws, "Tell me one more thing.", max_tokens=6)
    assert first.errors == [] and second.errors == []
    return first.done, second.done


async def test_chats_spread_and_reuse_their_cache(cluster: Cluster, token: str):
    cids = [new_chat(cluster.front.url, token) for _ in range(9)]
    results = await asyncio.gather(*(two_turns(cluster, token, c) for c in cids))
    for first, second in results:
        assert first["usage"]["cached_tokens"] == 0
        assert second["usage"]["cached_tokens"] > 0  # turn 2 found turn 1's KV
        assert second["usage"]["recomputed_tokens"] == 0
    homes = {c: cluster.home(c) for c in cids}
    assert all(homes.values())
    assert len(set(homes.values())) >= 2, homes  # spread over replicas
    held = held_by(cluster)
    for cid, home in homes.items():  # each chat's cache is on its home, and only there
        assert cid in held[home]
        assert all(cid not in convs for r, convs in held.items() if r != home)
    listing = cluster.listing()
    assert len(listing["replicas"]) == 3
    for r in listing["replicas"]:
        assert r["alive"] and r["health"] == "ok"
        assert set(r) >= {"id", "url", "pid", "health", "pools", "conversations"}
        assert r["pools"]["gpu"]["total"] == 48
    assert sum(r["conversations"] for r in listing["replicas"]) >= 9


async def test_socket_on_another_replica_goes_to_the_home(cluster: Cluster, token: str):
    cid = new_chat(cluster.front.url, token)
    async with connect(cluster.front, cid, token) as ws:
        await say(ws, "First words.", max_tokens=6)
    home = cluster.server_of(cluster.home(cid))
    other = next(s for s in cluster.servers if s is not home)
    async with connect(home, cid, token) as ws1:
        await say(ws1, "Second words.", max_tokens=6)
        async with connect(other, cid, token) as ws2:  # relayed to the home
            with pytest.raises(websockets.ConnectionClosed):
                await recv(ws1, timeout=15)
            assert ws1.close_code == 4409
            reply = await say(ws2, "Third words.", max_tokens=6)
            assert reply.errors == []
            assert reply.done["usage"]["cached_tokens"] > 0  # served where the cache is
            async with connect(home, cid, token) as ws3:  # now the relayed one is older
                with pytest.raises(websockets.ConnectionClosed):
                    await recv(ws2, timeout=15)
                assert ws2.close_code == 4409
                await say(ws3, "Fourth words.", max_tokens=6)
    assert cluster.home(cid) == replica_id("127.0.0.1", home.port)
    assert cid not in held_by(cluster)[replica_id("127.0.0.1", other.port)]


async def test_api_request_matched_by_content_goes_to_the_home(cluster: Cluster, token: str):
    cid = new_chat(cluster.front.url, token)
    async with connect(cluster.front, cid, token) as ws:
        await say(ws, "A question for the API.", max_tokens=6)
    home = cluster.server_of(cluster.home(cid))
    other = next(s for s in cluster.servers if s is not home)
    history = [{"role": r, "content": c} for r, c, _ in messages(other.url, token, cid)]
    async with httpx.AsyncClient(timeout=60) as client:
        model = (await client.get(other.url + "/v1/models", headers=auth(token))).json()
        body = {
            "model": model["data"][0]["id"],
            "messages": [*history, {"role": "user", "content": "And a follow-up."}],
            "max_tokens": 6,
            "temperature": 0,
        }
        r = await client.post(other.url + "/v1/chat/completions", json=body, headers=auth(token))
    assert r.status_code == 200, r.text
    assert r.headers["x-session-id"] == cid  # the same conversation, continued
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert len(messages(home.url, token, cid)) == 4
    assert cid not in held_by(cluster)[replica_id("127.0.0.1", other.port)]


async def test_delete_on_another_replica_closes_the_socket_at_the_home(
    cluster: Cluster, token: str
):
    cid = new_chat(cluster.front.url, token)
    async with connect(cluster.front, cid, token) as ws:
        await say(ws, "Soon gone.", max_tokens=4)
        home = cluster.home(cid)
        other = next(s for s in cluster.servers if replica_id("127.0.0.1", s.port) != home)
        r = httpx.delete(f"{other.url}/api/conversations/{cid}", headers=auth(token))
        assert r.status_code == 204, r.text
        with pytest.raises(websockets.ConnectionClosed):
            await recv(ws, timeout=15)
        assert ws.close_code == 4404  # the home closed it: the DELETE was handed there
    assert cid not in held_by(cluster)[home]


async def test_forged_forward_mark_is_ignored(cluster: Cluster, token: str):
    cid = new_chat(cluster.front.url, token)
    async with connect(cluster.front, cid, token) as ws:
        await say(ws, "Hi.", max_tokens=4)
    home = cluster.server_of(cluster.home(cid))
    other = next(s for s in cluster.servers if s is not home)
    forged = {"X-Pensieve-Forwarded": "0" * 64, "X-Pensieve-Host": "evil.example"}
    async with connect(other, cid, token, additional_headers=forged) as ws:
        reply = await say(ws, "Again.", max_tokens=4)
    assert reply.done["usage"]["cached_tokens"] > 0  # still handed to the home
    assert cluster.home(cid) == replica_id("127.0.0.1", home.port)


def test_admin_page_shows_every_replica(cluster: Cluster, token: str):
    from tests.app.test_web import ARGS, CHROMIUM

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install chromium (make browser)")
    from playwright.sync_api import sync_playwright

    held = {r: convs for r, convs in held_by(cluster).items() if convs}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(cluster.front.url + "/admin#token=" + ADMIN)
        rows = page.locator("#cluster .replica-row[data-replica]")
        page.wait_for_function(
            "() => document.querySelectorAll('#cluster [data-replica]').length == 3"
        )
        assert rows.count() == 3
        for replica, convs in held.items():
            row = page.locator(f"#cluster [data-replica='{replica}']")
            assert row.locator(".badge").inner_text() == "ok"
            shown = row.locator("details .conv-id").evaluate_all("els => els.map(e => e.title)")
            assert set(shown) & convs  # the conversations it holds
        browser.close()
    assert errors == []


async def reconnect_and_say(cluster: Cluster, token: str, cid: str, text: str):
    """Through the front, until a replica takes the socket (HAProxy may still be marking the
    dead one down)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            async with connect(cluster.front, cid, token) as ws:
                return await say(ws, text, max_tokens=6)
        except (OSError, websockets.ConnectionClosed, websockets.InvalidStatus):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)


async def test_sigkill_of_the_home_then_the_chat_goes_on_elsewhere(cluster: Cluster, token: str):
    cid = new_chat(cluster.front.url, token)
    async with connect(cluster.front, cid, token) as ws:
        first = await say(ws, "Remember the number seven.", max_tokens=6)
        second = await say(ws, "And the colour blue.", max_tokens=6)
        dead_id = cluster.home(cid)
        dead = cluster.server_of(dead_id)
        await ws.send(
            json.dumps({"type": "message", "content": "Write at length.", "max_tokens": 400})
        )
        assert (await recv(ws))["type"] == "token"  # mid-reply
        dead.kill()
        with pytest.raises(websockets.ConnectionClosed):
            while True:
                await recv(ws, timeout=15)
    after = await reconnect_and_say(cluster, token, cid, "What did I ask you to remember?")
    assert after.errors == []
    assert after.done["usage"]["recomputed_tokens"] > 0  # rebuilt from SQL
    new_home = cluster.home(cid)
    assert new_home and new_home != dead_id
    alive = next(s for s in cluster.servers if s is not dead)
    assert messages(alive.url, token, cid) == [
        ("user", "Remember the number seven.", None),
        ("assistant", first.text, first.done["finish_reason"]),
        ("user", "And the colour blue.", None),
        ("assistant", second.text, second.done["finish_reason"]),
        ("user", "Write at length.", None),
        ("assistant", "", "error"),  # the half-streamed reply, closed as after a restart
        ("user", "What did I ask you to remember?", None),
        ("assistant", after.text, after.done["finish_reason"]),
    ]
    # The next turn stays on the new home and finds its cache.
    again = await reconnect_and_say(cluster, token, cid, "One more.")
    assert (
        again.done["usage"]["cached_tokens"] > 0 and again.done["usage"]["recomputed_tokens"] == 0
    )
    deadline = time.monotonic() + ALIVE_TTL_S + 5
    while time.monotonic() < deadline:
        down = {r["id"]: r for r in cluster.listing(alive.url)["replicas"]}[dead_id]
        if not down["alive"]:
            break
        await asyncio.sleep(0.5)
    assert not down["alive"] and down["health"] == "down"


async def test_restarted_replica_rejoins(cluster: Cluster, token: str):
    dead = next((s for s in cluster.servers if s.proc.poll() is not None), None)
    if dead is None:  # run alone: kill one first
        dead = cluster.servers[0]
        dead.kill()
    old_pid = dead.proc.pid
    dead.start()
    cluster.wait_front_up(dead)
    me = replica_id("127.0.0.1", dead.port)
    entry = {r["id"]: r for r in cluster.listing()["replicas"]}[me]
    assert entry["alive"] and entry["pid"] == dead.proc.pid != old_pid
    # Its share of the ring comes back: new chats through the front land on it again.
    landed = None
    for _ in range(24):
        cid = new_chat(cluster.front.url, token)
        async with connect(cluster.front, cid, token) as ws:
            await asyncio.sleep(0)  # the connection claims the chat's home
            if cluster.home(cid) == me:
                landed = cid
                reply = await say(ws, "Hello again.", max_tokens=4)
                assert reply.errors == []
                break
    assert landed is not None
    assert landed in held_by(cluster)[me]
