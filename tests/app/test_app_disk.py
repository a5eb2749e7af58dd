"""The disk tier through the server: contexts come back from files after a graceful stop
and after a SIGKILL (what was dropped, or written while idle, before it), with the reply
the engine gives on the stored stream."""

from __future__ import annotations

import asyncio

import pytest

from engine import Engine, EngineConfig, SamplingParams, Turn
from store import HistoryStore
from tests.app_fixtures import Server, connect, say

pytestmark = pytest.mark.timeout(400)

# Small tiers: one long chat pushes another's chunks out of memory, onto the disk tier.
ENV = {"PENSIEVE_GPU_CACHE_CHUNKS": "10", "PENSIEVE_CPU_CACHE_CHUNKS": "2"}
LONG = "Describe, in careful detail, how a lighthouse keeper spends a winter night. " * 12


async def oracle(url: str, cid: str, text: str, model: str = "smollm2-135m-instruct") -> None:
    """The engine run directly on the stored stream before the last reply gives it."""
    store = HistoryStore(url)
    await store.start()
    try:
        reply = (await store.messages(cid))[-1]
        stream = await store.stream(cid)
    finally:
        await store.close()
    engine = Engine(EngineConfig(model, "cpu", gpu_cache_chunks=64, cpu_cache_chunks=0))
    try:
        prompt = stream[: reply.token_start]
        sp = SamplingParams(max_tokens=max(1, len(reply.token_ids)))
        [r] = engine.run([Turn("oracle", prompt, sp)])
    finally:
        engine.close()
    assert reply.content == text and r.token_ids == reply.token_ids


async def test_contexts_come_back_from_disk_after_a_stop_then_a_sigkill(tmp_path):
    url = f"sqlite+aiosqlite:///{tmp_path}/pensieve.db"
    env = {**ENV, "PENSIEVE_DISK_CACHE_DIR": str(tmp_path / "kv")}
    srv = Server(url, tmp_path / "server.log", env=env).start()
    try:
        token = srv.user("keeper")
        first, second = srv.new_chat(token), srv.new_chat(token)
        async with connect(srv, first, token) as ws:
            await say(ws, LONG, max_tokens=12)
        async with connect(srv, second, token) as ws:  # pushes the first chat out of memory
            await say(ws, LONG.replace("winter", "summer"), max_tokens=12)
        # A graceful stop writes what memory holds on the way out; the first chat was dropped
        # to disk before. Then, with both back in memory, a SIGKILL after an idle moment:
        # the engine writes what memory holds while idle.
        for stop, question in (("sigterm", "And then?"), ("sigkill", "And after that?")):
            if stop == "sigkill":
                await asyncio.sleep(2)
                srv.kill()
            else:
                srv.stop()
            srv.start()
            for cid in (first, second):
                async with connect(srv, cid, token) as ws:
                    after = await say(ws, question, max_tokens=12)
                assert after.errors == [], stop
                usage = after.done["usage"]
                assert usage["disk_tokens"] > 0, (stop, usage)
                assert usage["recomputed_tokens"] < usage["disk_tokens"], (stop, usage)
                await oracle(url, cid, after.text)
    finally:
        srv.stop()
    assert "Traceback" not in srv.log_tail(100_000)
