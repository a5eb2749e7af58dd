"""A chat that outgrows the model's context goes on: the oldest turns leave the window,
the KV is rebuilt, the history keeps everything, and a restart recomputes the window."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from engine import EngineConfig
from engine.model.loader import convert_bundled
from store import HistoryStore
from tests.app_fixtures import Server, connect, say
from tests.oracle import hf_greedy, hf_model

pytestmark = pytest.mark.timeout(600)

# 12 GPU chunks of 32 tokens: a chat holds at most 383 tokens.
SMALL = {"PENSIEVE_GPU_CACHE_CHUNKS": "12", "PENSIEVE_CPU_CACHE_CHUNKS": "16"}
LIMIT = 12 * 32 - 1
REPLY = 16


def question(i: int) -> str:
    return f"Tell me one short fact about the number {i}, please."


async def test_chat_continues_past_the_context_limit(tmp_path):
    url = f"sqlite+aiosqlite:///{tmp_path}/pensieve.db"
    srv = Server(url, tmp_path / "server.log", env=SMALL).start()
    dones: list[dict] = []
    try:
        token = srv.user("talker")
        cid = srv.new_chat(token, system_prompt="You are brief.")
        async with connect(srv, cid, token) as ws:
            i, rebuilt = 0, 0
            while i < 30 and rebuilt < 2:  # up to the second fresh window
                r = await say(ws, question(i), max_tokens=REPLY)
                assert r.errors == [], r.errors
                before = dones[-1]["turns_left_out"] if dones else 0
                rebuilt += r.done["turns_left_out"] > before
                dones.append(r.done)
                i += 1
        assert rebuilt == 2, "the chat never left its window"
        srv.stop()
        srv.start()  # no cache now: the fresh window comes back from SQL
        async with connect(srv, cid, token) as ws:
            after = await say(ws, question(i), max_tokens=REPLY)
        assert after.errors == []
        assert after.done["turns_left_out"] == dones[-1]["turns_left_out"]  # same window
        assert after.done["usage"]["recomputed_tokens"] > 100
        dones.append(after.done)
        history = srv.chat(token, cid)["messages"]
    finally:
        srv.stop()

    left = [d["turns_left_out"] for d in dones]
    assert left == sorted(left) and left[0] == 0 and left[-1] > 0
    first_fresh = left.index(next(n for n in left if n > 0))
    assert dones[first_fresh]["usage"]["cached_tokens"] == 0  # the KV was rebuilt
    # Every message stays in the stored history and on the page.
    assert [m["content"] for m in history if m["role"] == "user"] == [
        question(k) for k in range(len(dones))
    ]
    assert len(history) == 2 * len(dones)

    store = HistoryStore(url)
    await store.start()
    try:
        messages = await store.messages(cid)
        window = await store.stream(cid)
    finally:
        await store.close()
    assert len(window) <= LIMIT
    opener = max(k for k, m in enumerate(messages) if m.starts_context)
    assert window == [t for m in messages[opener:] for t in m.token_ids]
    assert sum(m.role == "user" for m in messages[:opener]) >= left[-1]

    # Oracle: transformers, greedy on each reply's window context, gives that reply.
    tok = AutoTokenizer.from_pretrained(convert_bundled(None))
    stop = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    model = hf_model(SimpleNamespace(config=EngineConfig(device="cpu")))
    checked = 0
    for k, m in enumerate(messages):
        if m.role != "assistant" or k < 2 * first_fresh:
            continue
        start = max(j for j in range(k) if j == 0 or messages[j].starts_context)
        context = [t for msg in messages[start:k] for t in msg.token_ids]
        # The fresh window renders the system prompt and the latest turns, as text.
        text = tok.decode(context)
        assert text.startswith("<|im_start|>system\nYou are brief.<|im_end|>")
        assert question(0) not in text
        assert hf_greedy(model, context, REPLY, stop) == m.token_ids, k
        checked += 1
    assert checked >= 4
