"""Shared prefix chunks in the engine: 32 conversations with one 1,000-token system prompt
hold it once; replies equal those of an unshared engine and of Hugging Face transformers
through swaps, drops and recomputes; a restart recomputes from history."""

from __future__ import annotations

import random

import pytest

from engine import Engine, EngineConfig, MemoryHistory, SamplingParams, Turn
from tests.engine.test_engine_equality import TEXTS
from tests.oracle import hf_greedy, hf_model


def make(model: str, **kw) -> Engine:
    return Engine(EngineConfig(model=model, device="cpu", **kw))


def test_32_conversations_hold_a_1000_token_system_prompt_once():
    rng = random.Random(0)
    system = [rng.randrange(5, 5000) for _ in range(1000)]
    prompts = [system + [rng.randrange(5, 5000) for _ in range(5)] for _ in range(32)]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    engine = make("dummy:tiny", gpu_cache_chunks=96, cpu_cache_chunks=16)
    # Two start together (neither finds the other's chunks: they compute both and the
    # second hands its copy back when it ends); the thirty after them link the chunks.
    first = engine.run([Turn(f"c{i}", prompts[i], sp) for i in range(2)])
    rest = engine.run([Turn(f"c{i}", prompts[i], sp) for i in range(2, 32)])
    engine.cache.check()

    snap = engine.snapshot()
    cs = snap.chunk_size
    full = 1000 // cs  # 31 chunks hold only system prompt tokens
    for conv in snap.conversations:
        assert conv.holders == (32,) * full + (1,), conv.id
    assert (snap.sharing.chunks, snap.sharing.holders) == (full, 32 * full)
    assert snap.gpu.used + snap.cpu.used == full + 32  # unshared: 32 x 32 blocks
    assert snap.counters.shared_tokens == 30 * full * cs
    assert all(r.stats.shared_tokens == full * cs for r in rest)
    assert all(r.stats.shared_tokens == 0 for r in first)
    shown = snap.to_dict()
    assert shown["sharing"]["saved_blocks"] == 31 * full
    assert shown["conversations"][5]["holders"][:full] == [32] * full

    # Greedy output is the same as without sharing (a linked one and both that started
    # together; the unshared run of all 32 would take a minute here).
    alone = make("dummy:tiny", gpu_cache_chunks=96, cpu_cache_chunks=0, share_prefixes=False)
    for i in (0, 1, 7):
        want = alone.run([Turn(f"u{i}", prompts[i], sp)])[0].token_ids
        assert (first + rest)[i].token_ids == want, i


def plan_turns(engine: Engine, n_convs: int, n_turns: int, system_len: int, seed: int):
    """Prompts of real text per conversation and turn; every first prompt starts with the
    same `system_len` tokens."""
    tok = engine.tokenizer
    system = tok.encode(" ".join(TEXTS * 3), add_special_tokens=False)[:system_len]
    assert len(system) == system_len
    rng = random.Random(seed)
    return [
        [
            (system if t == 0 else [])
            + tok.encode(rng.choice(TEXTS), add_special_tokens=False)[: rng.randint(8, 40)]
            for t in range(n_turns)
        ]
        for _ in range(n_convs)
    ]


def serve(engine: Engine, plan, max_tokens: int) -> list[list[list[int]]]:
    """The first conversation's first turn ends before the others start (they link its
    chunks); then every conversation's turns run together."""
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    n = len(plan)
    out: list[list[list[int]]] = [[] for _ in range(n)]
    waves = [[(0, 0)], [(i, 0) for i in range(1, n)]]
    waves += [[(i, t) for i in range(n)] for t in range(1, len(plan[0]))]
    for wave in waves:
        results = engine.run([Turn(f"s{i}", plan[i][t], sp) for i, t in wave])
        for (i, _), r in zip(wave, results, strict=True):
            out[i].append(r.token_ids)
        engine.cache.check()
    return out


def check_hf(hf, plan, got, max_tokens: int) -> None:
    for i, turns in enumerate(plan):
        context: list[int] = []
        for t, prompt in enumerate(turns):
            context += prompt
            assert got[i][t] == hf_greedy(hf, context, max_tokens, set()), (i, t)
            context += got[i][t]


def test_replies_equal_hf_and_unshared_through_swaps_and_drops():
    """4 conversations x 3 turns that start with the same 4-chunk system prompt, on pools
    that force swaps, drops and recomputes of shared and private chunks."""
    kw = dict(gpu_cache_chunks=12, cpu_cache_chunks=4, max_batch_tokens=64)
    shared = make("dummy:tiny", **kw)
    plan = plan_turns(shared, 4, 3, 128, seed=5)
    got = serve(shared, plan, 16)
    counters = shared.snapshot().counters
    assert counters.shared_tokens == 3 * 128
    assert counters.swapped_in_tokens > 0 and counters.recomputed_tokens > 0, counters
    assert counters.dropped_tokens > 0, counters
    assert got == serve(make("dummy:tiny", share_prefixes=False, **kw), plan, 16)
    check_hf(hf_model(shared), plan, got, 16)


def test_bundled_model_replies_equal_hf_with_linked_chunks():
    engine = make("smollm2-135m-instruct", gpu_cache_chunks=64, cpu_cache_chunks=8)
    plan = plan_turns(engine, 3, 2, 64, seed=6)
    got = serve(engine, plan, 8)
    assert engine.snapshot().counters.shared_tokens == 2 * 64
    check_hf(hf_model(engine), plan, got, 8)


def test_restart_and_edit_inside_the_shared_prompt():
    """A restarted engine recomputes a conversation from history; an edit inside the shared
    prompt cuts it back without touching the others' chunks."""
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    system = list(range(100, 170))  # 2 full chunks of 32
    history = MemoryHistory()
    engine = make("dummy:tiny", gpu_cache_chunks=32, cpu_cache_chunks=8)
    a = engine.run([Turn("a", system + [1, 2], sp)])[0].token_ids
    b = engine.run([Turn("b", system + [3, 4], sp)])[0].token_ids
    assert engine.snapshot().sharing.chunks == 2
    # b's history is cut inside the second shared chunk and goes on from there
    edited = engine.run([Turn("b", [9, 9], sp, context_len=40)])[0].token_ids
    assert engine.cache.holders(engine.cache.tables["a"]) == [1, 1, 1]
    engine.cache.check()
    alone = make("dummy:tiny", gpu_cache_chunks=32, share_prefixes=False)
    assert alone.run([Turn("x", system[:40] + [9, 9], sp)])[0].token_ids == edited
    assert alone.run([Turn("y", system + [1, 2], sp)])[0].token_ids == a

    history.append("b", system + [3, 4] + b)
    restarted = Engine(
        EngineConfig(model="dummy:tiny", device="cpu", gpu_cache_chunks=32), history=history
    )
    got = restarted.run([Turn("b", [5], sp, context_len=len(system) + 2 + len(b))])[0]
    want = alone.run([Turn("z", system + [3, 4] + b + [5], sp)])[0].token_ids
    assert got.token_ids == want
    assert got.stats.recomputed_tokens == len(system) + 2 + len(b)


def test_fork_links_the_parents_chunks_and_replies_like_a_fresh_chat():
    """A fork starts a conversation on a prefix of another's stream: the parent's full
    chunks of it are linked, not recomputed; greedy replies equal the same tokens run
    fresh, for a fork at the parent's end, one inside its history, and after the parent
    went on; an unknown or stale parent links nothing and the fork recomputes."""
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    engine = make("dummy:tiny", gpu_cache_chunks=48, cpu_cache_chunks=8)
    first = list(range(100, 180))  # 2 full chunks and a part
    out1 = engine.run([Turn("p", first, sp)])[0].token_ids
    second = list(range(300, 340))
    out2 = engine.run([Turn("p", second, sp)])[0].token_ids
    stream = first + out1 + second + out2  # 132 tokens: 4 full chunks
    alone = make("dummy:tiny", gpu_cache_chunks=48, share_prefixes=False)

    def fresh(tokens: list[int]) -> list[int]:
        alone.free("fresh")
        return alone.run([Turn("fresh", tokens, sp)])[0].token_ids

    # At the parent's end: the 4 full chunks are linked, only the rest is computed.
    assert engine.fork("p", "f1", stream, parent_len=len(stream)) == 4 * 32
    r = engine.run([Turn("f1", [7, 8, 9], sp, context_len=len(stream))])[0]
    assert r.stats.cached_tokens == 4 * 32 and r.stats.recomputed_tokens == 0
    assert r.token_ids == fresh(stream + [7, 8, 9])
    # Inside the history (after the first turn): its 2 full chunks.
    early = first + out1
    assert engine.fork("p", "f2", early, parent_len=len(stream)) == 2 * 32
    r = engine.run([Turn("f2", [5, 6], sp, context_len=len(early))])[0]
    assert r.token_ids == fresh(early + [5, 6])
    # The parent goes on over its now shared chunks, and replies as if never forked.
    r = engine.run([Turn("p", [11, 12], sp)])[0]
    assert r.token_ids == fresh(stream + [11, 12])
    engine.cache.check()
    snap = {c.id: c for c in engine.snapshot().conversations}
    assert snap["f1"].holders[:2] == (3, 3) and snap["f1"].holders[2:4] == (2, 2)

    # Nothing to link: a parent the engine does not know, or whose length differs.
    assert engine.fork("nobody", "f3", stream) == 0
    assert engine.fork("p", "f4", stream, parent_len=len(stream) - 1) == 0
    assert "f4" not in engine.streams and "f4" not in engine.cache.tables
    with pytest.raises(ValueError, match="exists"):
        engine.fork("p", "f1", stream)

    # A fork the engine could not link recomputes from history (as after a restart).
    history = MemoryHistory()
    history.append("g", early)
    cold = Engine(
        EngineConfig(model="dummy:tiny", device="cpu", gpu_cache_chunks=48), history=history
    )
    assert cold.fork("p", "g", early) == 0
    r = cold.run([Turn("g", [5, 6], sp, context_len=len(early))])[0]
    assert r.stats.recomputed_tokens == len(early)
    assert r.token_ids == fresh(early + [5, 6])
