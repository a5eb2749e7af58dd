"""`Engine.rewrite`: a conversation's last tokens replaced by others that its next turn
computes (a thinking reply re-encoded as the chat template renders it in history)."""

from __future__ import annotations

import asyncio

import pytest

from engine import AsyncEngine, Engine, EngineConfig, SamplingParams, Turn

SP = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def tiny(**kw) -> Engine:
    return Engine(EngineConfig(model="dummy:tiny", device="cpu", **kw))


def prompt(n: int, start: int = 3) -> list[int]:
    return [start + i % 50 for i in range(n)]


def test_the_next_turn_computes_the_new_tail_and_sees_what_a_fresh_engine_sees():
    engine = tiny(gpu_cache_chunks=32, cpu_cache_chunks=8)
    p1, p2 = prompt(70), prompt(9, 100)
    out1 = engine.run([Turn("c", p1, SP)])[0].token_ids
    keep, tail = len(p1) - 5, [7, 8, 9, 10]  # the cut falls inside the turn's own prompt
    assert engine.rewrite("c", keep, tail, len(p1) + len(out1))
    engine.cache.check()
    state = engine.streams["c"]
    assert (state.length, state.kv_len, state.tail) == (keep + len(tail), keep, tail)
    assert engine.snapshot().counters.reencoded_tokens == len(tail)

    second = engine.run([Turn("c", p2, SP)])[0]
    engine.cache.check()
    assert second.stats.cached_tokens == keep  # the history before the cut stays
    fresh = tiny(gpu_cache_chunks=32).run([Turn("c", p1[:keep] + tail + p2, SP)])[0]
    assert second.token_ids == fresh.token_ids


def test_refused_for_unknown_chats_and_another_length():
    engine = tiny(gpu_cache_chunks=32, cpu_cache_chunks=8)
    out = engine.run([Turn("c", prompt(40), SP)])[0].token_ids
    assert not engine.rewrite("nobody", 0, [1], 0)
    assert not engine.rewrite("c", 10, [1], 40 + len(out) + 1)  # the caller knows another
    assert not engine.rewrite("c", 41 + len(out), [1], 40 + len(out))  # past the end
    assert engine.streams["c"].length == 40 + len(out)
    assert engine.snapshot().counters.reencoded_tokens == 0


def test_dropped_chunks_come_back_from_the_rewritten_history():
    """Small tiers: the rewritten chat's chunks are dropped by others and recomputed from
    the history the engine keeps, which holds the new tail."""
    engine = tiny(gpu_cache_chunks=8, cpu_cache_chunks=2)
    p1 = prompt(120)
    out1 = engine.run([Turn("c", p1, SP)])[0].token_ids
    keep, tail = len(p1) - 2, [11, 12, 13]
    assert engine.rewrite("c", keep, tail, len(p1) + len(out1))
    for i in range(3):  # other chats push its chunks out of both tiers
        engine.run([Turn(f"o{i}", prompt(150, 20 + i), SP)])
        engine.cache.check()
    p2 = prompt(5, 200)
    second = engine.run([Turn("c", p2, SP)])[0]
    engine.cache.check()
    assert second.stats.recomputed_tokens > 0
    fresh = tiny(gpu_cache_chunks=32).run([Turn("c", p1[:keep] + tail + p2, SP)])[0]
    assert second.token_ids == fresh.token_ids


def test_the_async_front_rewrites_on_its_loop():
    async def main() -> None:
        engine = AsyncEngine(EngineConfig(model="dummy:tiny", device="cpu", gpu_cache_chunks=32))
        await engine.start()
        try:
            out = (await engine.generate(Turn("c", prompt(40), SP))).token_ids
            assert await engine.rewrite("c", 38, [5, 6], 40 + len(out))
            assert not await engine.rewrite("c", 38, [5, 6], 40 + len(out))  # moved on
            second = await engine.generate(Turn("c", [9, 9], SP, context_len=40))
            assert second.stats.cached_tokens == 38
        finally:
            await engine.stop()

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["gpu", "stateless"])
def test_other_cache_modes_keep_their_accounting(mode):
    engine = tiny(gpu_cache_chunks=32, cpu_cache_chunks=8, cache_mode=mode)
    p1 = prompt(50)
    out1 = engine.run([Turn("c", p1, SP)])[0].token_ids
    assert engine.rewrite("c", 45, [4, 4], len(p1) + len(out1))
    engine.cache.check()
    second = engine.run([Turn("c", [8, 9], SP)])[0]
    engine.cache.check()
    fresh = tiny(gpu_cache_chunks=32).run([Turn("c", p1[:45] + [4, 4, 8, 9], SP)])[0]
    assert second.token_ids == fresh.token_ids
