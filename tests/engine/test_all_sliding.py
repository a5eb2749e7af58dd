"""A model whose every layer slides (Mistral, Phi-3 mini 4k; engine/kv_layout.py `gone`): a
chunk the window has left is needed by no layer, so it is freed on every tier and never
recomputed while the chunks after it are held; once one of those is lost, the recompute runs
from position 0 (each layer's KV depends on every position before it). Seen through
`Engine`, with greedy equality with transformers through every move."""

from __future__ import annotations

import pytest

from engine import Engine, EngineConfig, SamplingParams, Turn
from tests.engine.test_engine_equality import prompts
from tests.engine.test_window_savings import chats  # 4 chats x 3 turns, one turn at a time
from tests.oracle import hf_greedy, hf_model

MODEL = "dummy:tiny-mistral"  # four layers, each sliding over 64 tokens


def engine(savings: bool = True, **kw) -> Engine:
    config = dict(device="cpu", gpu_cache_chunks=24, cpu_cache_chunks=0, max_batch_tokens=64)
    config.update(kw)
    return Engine(EngineConfig(model=MODEL, window_savings=savings, **config))


@pytest.fixture(scope="module")
def hf():
    return hf_model(engine())


def test_a_conversation_holds_only_its_window():
    e = engine()
    cs = e.cache.chunk_size
    assert e.pool.layout.gone and e.pool.layout.groups == 1
    e.run([Turn("a", list(range(100, 400)), SamplingParams(max_tokens=4, ignore_eos=True))])
    t = e.cache.find("a")
    chunks = -(-t.tokens // cs)
    kept = chunks - e.pool.layout.first_read(t.tokens - t.tokens % cs, cs)
    assert t.gone == chunks - kept > 0
    assert e.cache.usage("gpu")[1] == kept  # 3 of 10 chunks
    snap = e.snapshot()
    assert snap.kv_bytes["gpu"]["full"] == kept * e.pool.bytes_per_chunk
    # the admin page's view: the chunks the window left are gone, not dropped
    assert snap.conversations[0].chunks == ("gone",) * t.gone + ("gpu",) * kept
    # the next turn finds its window held: nothing is recomputed
    [r] = e.run([Turn("a", list(range(500, 540)), SamplingParams(max_tokens=4))])
    assert r.stats.recomputed_tokens == 0 and r.stats.cached_tokens > 0, r.stats
    e.cache.check()


def test_the_window_halves_what_the_same_chats_recompute():
    """A fixed first tier, no second: keeping only the window, the chats recompute at most
    half of what they recompute keeping every chunk."""
    kept, every = chats(engine(True)), chats(engine(False))
    assert every.recomputed_tokens > 0
    assert kept.recomputed_tokens <= every.recomputed_tokens / 2, (kept, every)


@pytest.mark.parametrize("cpu", [0, 6])
def test_greedy_equality_through_drops_past_the_window(hf, cpu):
    """Turns one conversation at a time in a first tier of 12 chunks (a recompute from
    position 0 needs the whole context there): returns find their window's chunks evicted
    by the others (recomputed from position 0, or swapped in from a small second tier), and
    equal transformers on the whole context."""
    e = engine(gpu_cache_chunks=12, cpu_cache_chunks=cpu)
    plan = prompts(e, 6, 4, seed=3, min_len=40, max_len=64)
    contexts: list[list[int]] = [[] for _ in plan]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    from_start = 0  # turns that recomputed chunks gone before their window
    for t in range(4):
        for i, turns in enumerate(plan):
            gone = (x := e.cache.find(f"c{i}")) is not None and x.gone
            [r] = e.run([Turn(f"c{i}", turns[t], sp)])
            from_start += bool(gone and r.stats.recomputed_tokens > gone * e.cache.chunk_size)
            contexts[i] += turns[t]
            assert r.token_ids == hf_greedy(hf, contexts[i], 12, set()), (i, t)
            contexts[i] += r.token_ids
            e.cache.check()
    counters = e.snapshot().counters
    assert from_start > 0 and max(len(c) for c in contexts) > 150  # well past the window
    if cpu:
        assert counters.swapped_in_tokens > 0, counters


def test_a_cut_back_into_the_window_recomputes_from_the_start(hf):
    """A rewrite that moves the window back over chunks already gone recomputes them."""
    e = engine()
    first = list(range(100, 300))
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    [r] = e.run([Turn("a", first, sp)])
    assert e.cache.find("a").gone > 0
    cut = first[:40] + [7, 8, 9]  # the stream cut to 40 tokens, then a new message
    [r] = e.run([Turn("a", [7, 8, 9], sp, context_len=40)])
    assert r.token_ids == hf_greedy(hf, cut, 6, set())
    assert r.stats.recomputed_tokens >= 40, r.stats
    e.cache.check()
