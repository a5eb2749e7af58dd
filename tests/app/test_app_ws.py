"""The chat WebSocket end to end: a real server, the bundled model, SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets

from tests.app_fixtures import (
    TINY,
    auth,
    connect,
    recv,
    say,
    server_on,
    until_done,
    wait_for,
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server(request, tmp_path_factory):
    # A dropped socket's turn waits 1 s for the client to come back (tests/app/test_app_resume.py).
    env = {**TINY, "PENSIEVE_TURNS_PER_MINUTE": "1000", "PENSIEVE_RESUME_GRACE_S": "1"}
    with server_on(request.param, tmp_path_factory.mktemp("ws"), env) as srv:
        yield srv


@pytest.fixture(scope="module")
def token(server):
    return server.user("alice")


def roles(server, token, cid):
    return [(m["role"], m["finish_reason"]) for m in server.chat(token, cid)["messages"]]


async def test_stream_done_and_history(server, token):
    cid = server.new_chat(token, title="first")
    async with connect(server, cid, token) as ws:
        r1 = await say(ws, "Hi! What is the capital of France?", max_tokens=12)
        r2 = await say(ws, "And of Italy?", max_tokens=12)
    for r in (r1, r2):
        assert r.errors == []
        assert r.text and len(r.pieces) >= 2  # streamed, not one blob
        d = r.done
        assert d["finish_reason"] in ("stop", "length")
        assert set(d["usage"]) == {
            "prompt_tokens",
            "completion_tokens",
            "cached_tokens",
            "swapped_in_tokens",
            "recomputed_tokens",
            "prefetched_tokens",
            "disk_tokens",
            "reencoded_tokens",
        }
        assert 1 <= d["usage"]["completion_tokens"] <= 12
        assert 0 < d["timing"]["ttft_ms"] <= d["timing"]["total_ms"]
    # The second turn reuses the first turn's context instead of recomputing it.
    u2 = r2.done["usage"]
    assert u2["cached_tokens"] + u2["swapped_in_tokens"] + u2["recomputed_tokens"] > 0
    assert u2["prompt_tokens"] < 30  # only the new turn's tokens, not the whole chat
    chat = server.chat(token, cid)
    msgs = chat["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
    assert msgs[0]["content"] == "Hi! What is the capital of France?"
    assert msgs[1]["content"] == r1.text and msgs[3]["content"] == r2.text
    assert msgs[1]["tokens"] == r1.done["usage"]["completion_tokens"]
    assert msgs[3]["id"] == r2.done["message_id"]
    listed = httpx.get(server.url + "/api/conversations", headers=auth(token)).json()
    assert cid in [c["id"] for c in listed["conversations"]]


async def test_cancel_keeps_partial_reply_and_chat_goes_on(server, token):
    cid = server.new_chat(token)
    async with connect(server, cid, token) as ws:
        await ws.send(
            json.dumps(
                {
                    "type": "message",
                    "content": "Write a long story about a cat.",
                    "max_tokens": 400,
                    "temperature": 0.8,
                    "seed": 1,
                }
            )
        )
        first = await recv(ws)
        assert first["type"] == "token"
        await ws.send(json.dumps({"type": "cancel"}))
        r = await until_done(ws)
        assert r.done["finish_reason"] == "cancelled"
        assert r.done["usage"]["completion_tokens"] < 400
        again = await say(ws, "Thanks.", max_tokens=4)
        assert again.done["finish_reason"] in ("stop", "length")
        # A cancel right behind its message stops the turn even before it reaches the engine.
        await ws.send(
            json.dumps({"type": "message", "content": "Another story?", "max_tokens": 400})
        )
        await ws.send(json.dumps({"type": "cancel"}))
        quick = await until_done(ws)
        assert quick.done["finish_reason"] == "cancelled"
        assert quick.done["usage"]["completion_tokens"] < 50
    assert roles(server, token, cid) == [
        ("user", None),
        ("assistant", "cancelled"),
        ("user", None),
        ("assistant", again.done["finish_reason"]),
        ("user", None),
        ("assistant", "cancelled"),
    ]


async def test_disconnect_stops_the_turn_when_no_one_comes_back(server, token):
    cid = server.new_chat(token)
    async with connect(server, cid, token) as ws:
        await ws.send(
            json.dumps({"type": "message", "content": "Count to a thousand.", "max_tokens": 400})
        )
        assert (await recv(ws))["type"] == "token"

    # No reconnect within the grace: the turn stops, the engine no longer runs it and its
    # partial reply is committed.
    def stopped():
        snap = server.cache()
        conv = [c for c in snap["conversations"] if c["id"] == cid]
        return snap["counters"]["running"] == 0 and conv and not conv[0]["running"]

    assert wait_for(stopped, timeout=10)
    assert wait_for(lambda: len(roles(server, token, cid)) == 2, timeout=10)
    assert roles(server, token, cid)[1] == ("assistant", "cancelled")
    assert server.chat(token, cid)["messages"][1]["tokens"] < 400


async def test_newer_connection_replaces_older(server, token):
    cid = server.new_chat(token)
    async with connect(server, cid, token) as old, connect(server, cid, token) as new:
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await recv(old, timeout=10)
        assert closed.value.rcvd.code == 4409
        r = await say(new, "Hello", max_tokens=4)
        assert r.errors == [] and r.done["type"] == "done"


async def _close_code(server, cid, token, **kw) -> int:
    async with connect(server, cid, token, **kw) as ws:
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await recv(ws, timeout=10)
    return closed.value.rcvd.code


async def test_close_codes(server, token):
    cid = server.new_chat(token)
    assert await _close_code(server, cid, None) == 4401
    assert await _close_code(server, cid, "not-a-token") == 4401
    assert await _close_code(server, cid, server.user("mallory")) == 4403
    assert await _close_code(server, "0" * 32, token) == 4404
    evil = {**auth(token), "Origin": "http://evil.example"}
    assert await _close_code(server, cid, None, additional_headers=evil) == 4403


async def test_bad_frames_get_one_error_each(server, token):
    cid = server.new_chat(token)
    too_long = "x" * 16_001
    bad = [
        ("not json", "bad_json"),
        (json.dumps([1, 2]), "bad_json"),
        (json.dumps({"type": "shout"}), "unknown_type"),
        (json.dumps({"type": "message"}), "bad_content"),
        (json.dumps({"type": "message", "content": "   "}), "bad_content"),
        (json.dumps({"type": "message", "content": 5}), "bad_content"),
        (json.dumps({"type": "message", "content": too_long}), "too_long"),
        (json.dumps({"type": "message", "content": "hi", "temperature": -1}), "bad_sampling"),
        (json.dumps({"type": "message", "content": "hi", "temperature": "hot"}), "bad_sampling"),
        (json.dumps({"type": "message", "content": "hi", "top_p": 0}), "bad_sampling"),
        (json.dumps({"type": "message", "content": "hi", "max_tokens": 0}), "bad_sampling"),
        (json.dumps({"type": "message", "content": "hi", "max_tokens": 10**9}), "bad_sampling"),
        (json.dumps({"type": "message", "content": "hi", "max_tokens": True}), "bad_sampling"),
        (json.dumps({"type": "message", "content": "hi", "seed": 1.5}), "bad_sampling"),
        (b"\x00\x01binary", "binary"),
        ("[" * 50_000 + "]" * 50_000, "bad_json"),  # RecursionError in the JSON parser
        (json.dumps({"type": "message", "content": "a\x00b"}), "bad_content"),  # NUL
        ('{"type": "message", "content": "a\\ud800b"}', "bad_content"),  # lone surrogate
        (json.dumps({"type": "message", "content": "hi", "top_p": "x"}), "bad_sampling"),
    ]
    async with connect(server, cid, token) as ws:
        for frame, code in bad:
            await ws.send(frame)
            got = await recv(ws, timeout=10)
            assert got["type"] == "error" and got["code"] == code, (frame[:80], got)
            assert got["message"]
        # Fits a frame, not the chat: refused before anything is stored.
        await ws.send(json.dumps({"type": "message", "content": "lorem ipsum " * 1300}))
        got = await recv(ws, timeout=30)
        assert got["code"] == "too_long", got
        # The longest message of astral characters, each escaped as a surrogate pair
        # (12 bytes): a clear error frame, not a 1009 close.
        await ws.send(json.dumps({"type": "message", "content": "🙂" * 16_000}))
        got = await recv(ws, timeout=120)
        assert got["code"] == "too_long", got
        # Typing hints answer nothing; the connection still chats.
        await ws.send(json.dumps({"type": "typing"}))
        r = await say(ws, "Hello", max_tokens=4)
        assert r.errors == []
    assert roles(server, token, cid) == [("user", None), ("assistant", r.done["finish_reason"])]


async def test_flood_while_generating(server, token):
    cid = server.new_chat(token)
    async with connect(server, cid, token) as ws:
        await ws.send(
            json.dumps({"type": "message", "content": "Tell me about the sea.", "max_tokens": 40})
        )
        for i in range(6):
            await ws.send(json.dumps({"type": "message", "content": f"flood {i}"}))
        r = await until_done(ws)
        assert [e["code"] for e in r.errors] == ["busy"] * 6
        r2 = await say(ws, "Still there?", max_tokens=4)
        assert r2.errors == []
    contents = [m["content"] for m in server.chat(token, cid)["messages"] if m["role"] == "user"]
    assert contents == ["Tell me about the sea.", "Still there?"]


async def test_rest_refusals_and_delete(server, token):
    url = server.url + "/api/conversations"
    assert httpx.get(url).status_code == 401
    as_json = {**auth(token), "Content-Type": "application/json"}
    assert httpx.post(url, content=b"{", headers=as_json).status_code == 400
    assert httpx.post(url, content=b"{}", headers=auth(token)).status_code == 415
    assert httpx.post(url, json={"title": 5}, headers=auth(token)).status_code == 400
    assert httpx.post(url, json={"nope": 1}, headers=auth(token)).status_code == 400
    cid = server.new_chat(token, title="doomed", system_prompt="You are terse.")
    other = server.user("bob")
    assert httpx.get(f"{url}/{cid}", headers=auth(other)).status_code == 403
    assert httpx.delete(f"{url}/{cid}", headers=auth(other)).status_code == 403
    async with connect(server, cid, token) as ws:
        await say(ws, "Hi", max_tokens=4)
        assert any(c["id"] == cid for c in server.cache()["conversations"])
        assert httpx.delete(f"{url}/{cid}", headers=auth(token)).status_code == 204
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await recv(ws, timeout=10)
        assert closed.value.rcvd.code == 4404
    assert httpx.get(f"{url}/{cid}", headers=auth(token)).status_code == 404
    assert not any(c["id"] == cid for c in server.cache()["conversations"])
    assert httpx.get(server.url + "/api/admin/cache").status_code == 401
    assert httpx.get(server.url + "/api/admin/cache", headers=auth(token)).status_code == 401


async def test_health_and_metrics(server, token):
    health = httpx.get(server.url + "/healthz").json()
    assert health["status"] == "ok" and health["checks"]["redis"]["status"] == "disabled"
    text = httpx.get(server.url + "/metrics").text
    for name in (
        'pensieve:kv_cache_usage_perc{tier="gpu"}',
        'pensieve:kv_cache_usage_perc{tier="cpu"}',
        "pensieve:num_requests_running",
        "pensieve:prompt_tokens_total",
        "pensieve:generation_tokens_total",
        'pensieve:context_tokens_reused_total{tier="gpu"}',
        "pensieve:recomputed_tokens_total",
        "pensieve:dropped_tokens_total",
        "pensieve:shared_tokens_total",
        "pensieve:kv_cache_shared_chunks",
        "pensieve:kv_cache_shared_saved_blocks",
        'pensieve:swap_ahead_chunks_total{outcome="copied"}',
        'pensieve:swap_ahead_chunks_total{outcome="wasted"}',
        "pensieve:time_to_first_token_seconds_bucket",
        "pensieve:e2e_request_latency_seconds_count",
    ):
        assert name in text, name


async def test_concurrent_chats_share_the_engine(server, token):
    async def one(i):
        cid = server.new_chat(token)
        async with connect(server, cid, token) as ws:
            return await say(ws, f"Say the number {i}.", max_tokens=6)

    replies = await asyncio.gather(*(one(i) for i in range(3)))
    assert all(r.errors == [] and r.done["usage"]["completion_tokens"] >= 1 for r in replies)


def test_serving_benchmark_against_the_server(server, token, tmp_path):
    """`bench.serve --url`: the replay over REST and the chat WebSocket of a real server."""
    from bench import serve
    from bench.lib import workload as wl
    from bench.lib.samples import save_sample

    words = ["Tell me about tea.", "And coffee?", "Which is stronger?", "Thanks!"]
    convs = [
        wl.Conversation(f"c{i}", [wl.TurnSpec([1, 2, 3], 5, w) for w in words[i : i + 2 + i]])
        for i in range(2)
    ]
    sample = tmp_path / "sample.json"
    save_sample(sample, convs, {"summary": wl.summarize(convs), "source": "test"})
    out = tmp_path / "url.json"
    # --token=: a token may start with "-", which argparse would read as an option.
    argv = ["--url", server.url, f"--token={token}", "--preset", "tiny"]
    assert serve.main([*argv, "--sample-file", str(sample), "--out", str(out), "--no-plot"]) == 0
    run = json.loads(out.read_text())["runs"][0]
    m = run["metrics"]
    assert run["mode"] == "server" and m["errors"] == 0, m["error_samples"]
    assert m["turns"] == 5 and 0 < m["output_tokens"] <= 5 * 5
    assert m["norm_latency_p90"] > 0 and m["ttft_p90_s"] > 0
    # Later turns find their context kept, swapped or recomputed: never a fresh start.
    assert m["cached_tokens"] + m["swapped_in_tokens"] + m["recomputed_tokens"] > 0
