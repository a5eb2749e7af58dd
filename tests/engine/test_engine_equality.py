"""Greedy token equality with Hugging Face transformers across turns, through drops,
swaps, recomputes and suspensions, for the bundled model and dummy:tiny; every engine test
runs with steps in order and with the host a step ahead (`async_steps`)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import asdict

import pytest

from engine import Engine, EngineConfig, SamplingParams, Turn
from tests.oracle import hf_greedy, hf_model

MODELS = ["smollm2-135m-instruct", "dummy:tiny"]
TEXTS = [
    "Tell me about the moon.",
    "Write a short poem about the sea, the wind, and a lighthouse keeper who waits for a ship "
    "that never comes back to the harbour at dawn.",
    "What is 2 + 2?",
    "Explain, step by step and in plain words, how a hash table works, why lookups are fast "
    "on average, what happens on a collision, and when a table has to grow. " * 2,
    "Name three colours.",
]


def prompts(
    engine: Engine, n_convs: int, n_turns: int, seed: int, min_len: int = 3, max_len: int = 80
) -> list[list[list[int]]]:
    """Mixed-length prompts per conversation and turn, from real text."""
    tok = engine.tokenizer
    rng = random.Random(seed)
    out = []
    for _ in range(n_convs):
        turns = []
        for _ in range(n_turns):
            text = rng.choice(TEXTS)
            turns.append(
                tok.encode(text, add_special_tokens=False)[: rng.randint(min_len, max_len)]
            )
        out.append(turns)
    return out


def ticks() -> Callable[[], float]:
    """A clock that moves 1 ms per read: idle times (Cost/T), hence the cache's decisions, do
    not depend on how fast each engine's steps ran (for engines compared decision by
    decision; pass as `Engine(..., now=ticks())`)."""
    reads = itertools.count(1)
    return lambda: next(reads) * 1e-3


def check_against_hf(
    engine: Engine,
    hf,
    n_convs=4,
    n_turns=3,
    max_tokens=16,
    seed=0,
    min_len=3,
    max_len=80,
    ignore_eos=False,
) -> dict:
    """Run all conversations concurrently turn by turn; compare each reply with HF on the
    full context. Returns the engine counters for the caller to assert cache behaviour."""
    plan = prompts(engine, n_convs, n_turns, seed, min_len, max_len)
    contexts = [[] for _ in range(n_convs)]
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    stop = set() if ignore_eos else set(engine.stop_token_ids)
    for t in range(n_turns):
        turns = [Turn(f"c{i}-{seed}", plan[i][t], sp) for i in range(n_convs)]
        results = engine.run(turns)
        for i, r in enumerate(results):
            contexts[i] += plan[i][t]
            want = hf_greedy(hf, contexts[i], max_tokens, stop)
            assert r.token_ids == want, f"conversation {i}, turn {t}: {r.token_ids} != {want}"
            contexts[i] += r.token_ids
        engine.cache.check()
    return asdict(engine.snapshot().counters)


@pytest.fixture(scope="module", params=MODELS)
def model_name(request):
    return request.param


@pytest.fixture(scope="module")
def hf(model_name):
    engine = Engine(EngineConfig(model=model_name, device="cpu", gpu_cache_chunks=16))
    return hf_model(engine)


@pytest.fixture(scope="module")
def tiny_hf():
    return hf_model(Engine(EngineConfig(model="dummy:tiny", device="cpu", gpu_cache_chunks=16)))


@pytest.fixture(params=[False, True], ids=["in-step", "ahead"])
def ahead(request) -> bool:
    """`EngineConfig.async_steps`: the lagged step loop, or the one that reads each step's
    tokens before planning the next."""
    return request.param


def make(model_name, **kw) -> Engine:
    return Engine(EngineConfig(model=model_name, device="cpu", **kw))


def test_pensieve_swaps_drops_and_suspends(model_name, hf, ahead):
    """Both models: context comes back from the CPU, dropped leading chunks are recomputed,
    turns are suspended and resumed, and prompts are split across steps."""
    # 9 chunks hold any one conversation (at most 3 x 64 + 3 x 24 tokens) but not two.
    engine = make(
        model_name, async_steps=ahead, gpu_cache_chunks=9, cpu_cache_chunks=4, max_batch_tokens=64
    )
    counters = check_against_hf(
        engine, hf, max_tokens=24, seed=1, min_len=40, max_len=64, ignore_eos=True
    )
    assert counters["swapped_in_tokens"] > 0, counters
    assert counters["recomputed_tokens"] > 0, counters
    assert counters["cached_tokens"] > 0, counters
    assert counters["suspensions"] > 0, counters


def test_stateless_recomputes_everything(model_name, hf, ahead):
    engine = make(model_name, async_steps=ahead, gpu_cache_chunks=64, cache_mode="stateless")
    counters = check_against_hf(engine, hf, n_turns=2, seed=2)
    assert counters["cached_tokens"] == 0
    assert counters["recomputed_tokens"] > 0


# The cheap model covers the other modes too.


def test_gpu_mode_drops_and_recomputes(tiny_hf, ahead):
    # 10 chunks hold ~2 conversations: idle ones are dropped and recomputed from history.
    engine = make("dummy:tiny", async_steps=ahead, gpu_cache_chunks=10, cache_mode="gpu")
    counters = check_against_hf(engine, tiny_hf)
    assert counters["recomputed_tokens"] > 0
    assert counters["dropped_tokens"] > 0
    assert counters["swapped_in_tokens"] == 0


def test_large_cache_keeps_everything(tiny_hf, ahead):
    engine = make(
        "dummy:tiny", async_steps=ahead, gpu_cache_chunks=256, cpu_cache_chunks=0, cache_mode="gpu"
    )
    counters = check_against_hf(engine, tiny_hf, n_turns=3, seed=3)
    assert counters["recomputed_tokens"] == 0
    assert counters["cached_tokens"] > 0


def test_chunked_prefill_and_suspension(tiny_hf, ahead):
    # A tiny token budget splits prompts across steps; a pool this small forces suspensions.
    engine = make(
        "dummy:tiny",
        async_steps=ahead,
        gpu_cache_chunks=10,
        cpu_cache_chunks=32,
        max_batch_tokens=40,
    )
    counters = check_against_hf(
        engine, tiny_hf, n_convs=4, n_turns=2, max_tokens=48, seed=4, min_len=70
    )
    assert counters["suspensions"] > 0
