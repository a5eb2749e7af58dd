"""The `typing` frame prefetches: a real server with a tight GPU tier, a chat pushed to the
CPU tier by another, `typing` brings it back, and the `done` usage of the message that
follows says how many tokens prefetch brought back."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.app_fixtures import connect, say, server_on

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = {
        "PENSIEVE_GPU_CACHE_CHUNKS": "24",
        "PENSIEVE_CPU_CACHE_CHUNKS": "64",
        "PENSIEVE_TURNS_PER_MINUTE": "1000",
    }
    with server_on("sqlite", tmp_path_factory.mktemp("prefetch"), env) as srv:
        yield srv


def tiers(server, cid: str) -> list[str]:
    for c in server.cache()["conversations"]:
        if c["id"] == cid:
            return c["chunks"]
    return []


async def test_typing_then_message_finds_the_context_prefetched(server):
    token = server.user("typist")
    a, b = server.new_chat(token), server.new_chat(token)
    async with connect(server, a, token) as ws:
        await say(ws, "Tell me about apples. " + "Apples are red and sweet. " * 50, max_tokens=4)
    async with connect(server, b, token) as ws:  # needs most of the GPU tier: a goes to CPU
        await say(ws, "Tell me about pears. " + "Pears are green and soft. " * 90, max_tokens=4)
    assert "cpu" in tiers(server, a)
    async with connect(server, a, token) as ws:
        await ws.send(json.dumps({"type": "typing"}))
        for _ in range(200):  # the engine brings it back while the user types
            if "cpu" not in tiers(server, a):
                break
            await asyncio.sleep(0.05)
        r = await say(ws, "And their colour?", max_tokens=4)
    assert r.errors == []
    usage = r.done["usage"]
    assert usage["prefetched_tokens"] > 0
    assert usage["swapped_in_tokens"] == usage["recomputed_tokens"] == 0
