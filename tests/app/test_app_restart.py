"""A server stopped or killed mid-reply comes back with its history and recomputes the
lost context from SQL."""

from __future__ import annotations

import json

import pytest

from engine import Engine, EngineConfig, SamplingParams, Turn
from store import HistoryStore
from tests.app_fixtures import TINY, Server, connect, recv, say

pytestmark = pytest.mark.timeout(400)


async def test_restarts_during_generation_then_continue(tmp_path):
    url = f"sqlite+aiosqlite:///{tmp_path}/pensieve.db"
    srv = Server(url, tmp_path / "server.log", env=TINY).start()
    try:
        token = srv.user("survivor")
        cid = srv.new_chat(token, title="kept")
        long = {"type": "message", "content": "Write a long poem.", "max_tokens": 300}
        async with connect(srv, cid, token) as ws:
            first = await say(ws, "Hi! What is a pensieve?", max_tokens=16)
            await ws.send(json.dumps(long))
            assert (await recv(ws))["type"] == "token"
            srv.stop()  # SIGTERM: the running turn is cancelled and committed on the way out
        srv.start()
        msgs = srv.chat(token, cid)["messages"]
        assert [(m["role"], m["finish_reason"]) for m in msgs][2:] == [
            ("user", None),
            ("assistant", "cancelled"),
        ]
        partial = msgs[3]["content"]
        async with connect(srv, cid, token) as ws:
            await ws.send(json.dumps({**long, "content": "Write another long poem."}))
            assert (await recv(ws))["type"] == "token"
            srv.kill()  # SIGKILL while the reply is being generated
        srv.start()
        chat = srv.chat(token, cid)
        # Everything committed is there; the interrupted question too, without a reply.
        assert chat["title"] == "kept"
        assert [(m["role"], m["content"]) for m in chat["messages"]] == [
            ("user", "Hi! What is a pensieve?"),
            ("assistant", first.text),
            ("user", "Write a long poem."),
            ("assistant", partial),
            ("user", "Write another long poem."),
        ]
        async with connect(srv, cid, token) as ws:
            after = await say(ws, "Tell me more.", max_tokens=16)
        assert after.errors == []
        # The new process had no cache: the context came back from SQL.
        assert after.done["usage"]["recomputed_tokens"] > 0
    finally:
        srv.stop()

    # Oracle: the engine run directly on the stored stream before the reply gives that reply.
    store = HistoryStore(url)
    await store.start()
    try:
        messages = await store.messages(cid)
        stream = await store.stream(cid)
    finally:
        await store.close()
    reply = messages[-1]
    assert reply.role == "assistant" and reply.content == after.text
    prompt = stream[: reply.token_start]
    engine = Engine(EngineConfig(device="cpu", gpu_cache_chunks=64, cpu_cache_chunks=0))
    try:
        [result] = engine.run([Turn("oracle", prompt, SamplingParams(max_tokens=16))])
    finally:
        engine.close()
    assert result.token_ids == reply.token_ids
    # The interrupted turn left no reply, so the template re-rendered its end: the stored
    # stream was cut back to the common prefix and is exactly the rendered chat.
    chat = [{"role": m.role, "content": m.content} for m in messages[:-1]]
    rendered = engine.tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=False
    )
    assert engine.tokenizer.decode(prompt) == rendered
