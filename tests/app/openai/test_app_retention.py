"""Retention through the OpenAI APIs on a real server: `prompt_cache_retention` and the
extension `retention` accepted and refused with the field named (Chat Completions and
Responses), the per-owner cap of pinned bytes, pins in the admin data and /metrics, a pin
let go when its conversation is deleted, pins and disk keeps back after a restart, and
one owner's cap held by two servers together through Redis."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import httpx
import openai
import pytest

from engine.disk.keeps import NAME, parse
from tests import services
from tests.app_fixtures import TINY, Server, auth, connect, recv, say, server_on, wait_for

pytestmark = pytest.mark.timeout(300)

MODEL = "smollm2-135m-instruct"


# about 1.4 MB a chunk: one short pinned chat fits the cap, two do not
ENV = {**TINY, "PENSIEVE_TURNS_PER_MINUTE": "1000", "PENSIEVE_MAX_PINNED_MB_PER_OWNER": "4"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with server_on("sqlite", tmp_path_factory.mktemp("retention"), ENV) as srv:
        yield srv
    assert "Traceback" not in srv.log_tail(100_000)


def chat(server: Server, token: str, text: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4,
            "temperature": 0, **extra}  # fmt: skip
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth(token),
                      timeout=120)  # fmt: skip


def respond(server: Server, token: str, text: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "input": text, "max_output_tokens": 4, "temperature": 0, **extra}
    return httpx.post(server.url + "/v1/responses", json=body, headers=auth(token), timeout=120)


BAD = [
    ({"retention": {"ttl_s": -1}}, "retention.ttl_s"),
    ({"retention": {"ttl_s": 10, "priority": 101}}, "retention.priority"),
    ({"retention": {"ttl": 10}}, "retention.ttl"),
    ({"retention": "forever"}, "retention"),
    ({"prompt_cache_retention": "1h"}, "prompt_cache_retention"),
    ({"prompt_cache_retention": "24h"}, "prompt_cache_retention"),  # no disk tier here
]


@pytest.mark.parametrize("extra,param", BAD)
@pytest.mark.parametrize("api", [chat, respond])
def test_bad_retention_is_a_400_naming_the_field(server, api, extra, param):
    r = api(server, server.user("bad"), "hi", **extra)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"], error


def test_pins_are_capped_per_owner_shown_and_let_go_on_delete(server):
    alice, bob = server.user("alice"), server.user("bob")
    keep = {"retention": {"ttl_s": 600, "priority": 80}, "prompt_cache_retention": "in_memory"}
    first = chat(server, alice, "one", **keep)
    assert first.status_code == 200, first.text
    refused = chat(server, alice, "two", **keep)  # alice's second pin: past her cap
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "retention" and "cap" in error["message"], error
    assert chat(server, alice, "three").status_code == 200  # without a pin: served
    got = respond(server, bob, "four", retention={"ttl_s": 600})  # bob's own cap
    assert got.status_code == 200, got.text

    wait_for(lambda: server.cache()["pins"]["conversations"] == 2)
    pins = server.cache()["pins"]
    assert pins["gpu_bytes"] + pins["cpu_bytes"] > 0
    metrics = httpx.get(server.url + "/metrics").text
    assert 'pensieve:kv_cache_pinned_bytes{tier="gpu"}' in metrics

    cid = first.headers["x-session-id"]
    r = httpx.delete(f"{server.url}/api/conversations/{cid}", headers=auth(alice))
    assert r.status_code == 204
    r = httpx.delete(f"{server.url}/v1/responses/{got.json()['id']}", headers=auth(bob))
    assert r.status_code == 200
    wait_for(lambda: server.cache()["pins"]["conversations"] == 0)
    assert chat(server, alice, "five", **keep).status_code == 200  # room again


def test_the_openai_client_sends_the_fields(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=server.user("carol"), max_retries=0)
    reply = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=4,
        prompt_cache_key="carol-agent-1",
        extra_body={"retention": {"ttl_s": 0}},  # the session is done: its chunks go first
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


async def test_a_chat_socket_turn_takes_the_same_fields(server):
    """The chat socket's `message` frame carries the same fields: a bad one is an error frame
    naming it (nothing stored), a good one pins the chat (let go on delete)."""
    dave = server.user("dave")
    cid = server.new_chat(dave)
    before = pinned(server)
    async with connect(server, cid, dave) as ws:
        for extra, field in BAD:
            await ws.send(json.dumps({"type": "message", "content": "hi", **extra}))
            error = await recv(ws)
            assert error["type"] == "error" and error["code"] == "bad_retention", error
            assert field in error["message"], error
        assert server.chat(dave, cid)["messages"] == []  # the refused frames stored nothing
        r = await say(ws, "hi", max_tokens=4, retention={"ttl_s": 600})
        assert r.errors == [] and r.done["finish_reason"] in ("stop", "length")
    assert wait_for(lambda: pinned(server) == before + 1)
    r = httpx.delete(f"{server.url}/api/conversations/{cid}", headers=auth(dave))
    assert r.status_code == 204
    assert wait_for(lambda: pinned(server) == before)


def pinned(server: Server) -> int:
    return server.cache()["pins"]["conversations"]


def journal(kv: Path) -> tuple[Path, list[tuple[bytes, float]]]:
    """The disk tier's keeps as its directory holds them."""
    [path] = kv.glob(f"*/{NAME}")
    return path, parse(path.read_bytes())


def test_a_pin_and_a_disk_keep_are_back_after_a_restart(tmp_path):
    kv = tmp_path / "kv"
    with server_on("sqlite", tmp_path, {**ENV, "PENSIEVE_DISK_CACHE_DIR": str(kv)}) as srv:
        alice = srv.user("alice")
        keep = {"retention": {"ttl_s": 3600, "priority": 80}, "prompt_cache_retention": "24h"}
        first = chat(srv, alice, "one", **keep)
        assert first.status_code == 200, first.text
        srv.stop()
        path, before = journal(kv)
        assert before and all(until > time.time() + 86_000 for _, until in before)
        with open(path, "ab") as f:  # an expired keep and a torn line: gone once it is read
            f.write(b"ab" * 16 + b" 12.5\n" + b"cd" * 16 + b" 99")

        srv.start()  # the pin is back: alice's second pin is past her cap, as before
        assert wait_for(lambda: pinned(srv) == 1)
        refused = chat(srv, alice, "two", retention={"ttl_s": 600})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "pin_cap_exceeded"
        _, after = journal(kv)  # read back and compacted by the restarted tier
        assert dict(after) == dict(before)
        space = path.parent
        assert all(list(space.glob(f"{k.hex()[:2]}/{k.hex()}-*.kv")) for k, _ in after)

        cid = first.headers["x-session-id"]  # deleted: its pin and stored retention go
        r = httpx.delete(f"{srv.url}/api/conversations/{cid}", headers=auth(alice))
        assert r.status_code == 204
        with sqlite3.connect(tmp_path / "pensieve.db") as db:  # the database refuses the write
            db.execute("ALTER TABLE retention RENAME TO away")
        assert chat(srv, alice, "two", retention={"ttl_s": 600}).status_code == 200  # served
        assert wait_for(lambda: pinned(srv) == 1)
        assert "could not store the retention" in srv.log_tail()
    assert "Traceback" not in srv.log_tail(100_000)


def test_two_replicas_hold_an_owners_cap_together(tmp_path, redis_url):
    """Two servers on one database and one Redis: an owner's pin on one counts on the other
    (each alone would take it), and a deleted chat's pin frees the room on both."""
    db, url = services.new_database()
    env = {**ENV, "PENSIEVE_REDIS_URL": redis_url}
    a = Server(url, tmp_path / "a.log", env=env).start()
    b = Server(url, tmp_path / "b.log", env=env).start()
    try:
        alice = a.user("alice")
        keep = {"retention": {"ttl_s": 600}}
        first = chat(a, alice, "one", **keep)
        assert first.status_code == 200, first.text
        refused = chat(b, alice, "two", **keep)  # b holds no pin of alice's: Redis says a does
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "pin_cap_exceeded" and "all replicas" in error["message"]
        assert chat(b, alice, "three").status_code == 200  # without a pin: served
        cid = first.headers["x-session-id"]
        assert (
            httpx.delete(f"{a.url}/api/conversations/{cid}", headers=auth(alice)).status_code == 204
        )
        assert chat(b, alice, "two", **keep).status_code == 200  # room again, on b
    finally:
        a.stop()
        b.stop()
        services.drop_database(db)
    assert "Traceback" not in a.log_tail(100_000) + b.log_tail(100_000)


def test_a_dead_redis_leaves_the_cap_to_each_replica(tmp_path):
    """Redis at a wrong port: pinned turns are served and capped by this server's own pins,
    and the log says so once."""
    env = {**ENV, "PENSIEVE_REDIS_URL": "redis://127.0.0.1:1/0"}
    with server_on("sqlite", tmp_path, env) as srv:
        alice = srv.user("alice")
        keep = {"retention": {"ttl_s": 600}}
        assert chat(srv, alice, "one", **keep).status_code == 200
        refused = chat(srv, alice, "two", **keep)
        assert refused.json()["error"]["code"] == "pin_cap_exceeded", refused.text
        assert chat(srv, alice, "three").status_code == 200
        log = srv.log_tail(100_000)
    assert log.count("pin caps are counted per replica") == 1 and "Traceback" not in log
