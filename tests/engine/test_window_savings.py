"""Sliding layers keep only their window (engine/kv_layout.py), seen through `Engine`: the
same first tier holds more of a conversation, so the same chats recompute less; the pool's
pages per conversation are what the arithmetic of the window says."""

from __future__ import annotations

import random

import pytest

from engine import Engine, EngineConfig, SamplingParams, Turn
from engine.model.shapes import DUMMY_SHAPES

SHAPE = "tiny-gemma3"  # six layers, five sliding over 64 tokens


def engine(savings: bool, **kw) -> Engine:
    config = EngineConfig(
        model=f"dummy:{SHAPE}",
        device="cpu",
        gpu_cache_chunks=24,
        cpu_cache_chunks=0,
        window_savings=savings,
        **kw,
    )
    return Engine(config)


def chats(e: Engine, n_convs: int = 4, n_turns: int = 3, seed: int = 0) -> dict:
    """n_convs conversations taking turns, each turn 90-120 new tokens and 8 generated: to
    about 350 tokens each, 11 chunks (the tier holds 24 chunks of every layer)."""
    rng = random.Random(seed)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    for _ in range(n_turns):
        for i in range(n_convs):
            prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(90, 120))]
            e.run([Turn(f"c{i}", prompt, sp)])
            e.cache.check()
    return e.snapshot().counters


@pytest.mark.timeout(600)
def test_the_window_halves_what_the_same_chats_recompute():
    """A fixed first tier, no second: with five of six layers keeping only their window,
    the chats recompute at most half of what they recompute keeping every layer's KV."""
    kept = chats(engine(True))
    every = chats(engine(False))
    assert every.recomputed_tokens > 0
    assert kept.recomputed_tokens <= every.recomputed_tokens / 2, (kept, every)


def test_a_conversation_holds_the_pages_of_its_window():
    """One conversation past the window: its GPU pages are every chunk's full-layer page
    plus the sliding groups' pages of the chunks its window still reads."""
    e = engine(True)
    cs = e.cache.chunk_size
    prompt = list(range(100, 400))  # 300 tokens, then 4 generated: 304
    e.run([Turn("a", prompt, SamplingParams(max_tokens=4, ignore_eos=True))])
    args, layout = DUMMY_SHAPES[SHAPE], e.pool.layout
    assert (layout.groups, layout.slots) == (6, 1)
    tokens = e.cache.find("a").tokens
    chunks = -(-tokens // cs)
    window = chunks - layout.first_read(tokens - tokens % cs, cs)
    assert e.cache.usage("gpu")[1] == chunks + (layout.groups - 1) * window
    # the bytes per layer type the admin page and /metrics show
    page = layout.page_bytes(e.pool.bytes_per_chunk)
    assert e.snapshot().kv_bytes["gpu"] == {
        "full": chunks * page,
        "sliding": (layout.groups - 1) * window * page,
    }
    # the same conversation keeping every layer: `groups` pages a chunk
    e2 = engine(False)
    e2.run([Turn("a", prompt, SamplingParams(max_tokens=4, ignore_eos=True))])
    assert e2.pool.layout.groups == 1
    assert e2.cache.usage("gpu")[1] * args.n_layers == chunks * e2.pool.layout.slots
