"""Greedy token equality with Hugging Face transformers across turns, through drops,
swaps, recomputes and suspensions, for the bundled model and dummy:tiny."""

from __future__ import annotations

import random

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


def prompts(engine: Engine, n_convs: int, n_turns: int, seed: int) -> list[list[list[int]]]:
    """Mixed-length prompts per conversation and turn, from real text."""
    tok = engine.tokenizer
    rng = random.Random(seed)
    out = []
    for _ in range(n_convs):
        turns = []
        for _ in range(n_turns):
            text = rng.choice(TEXTS)
            turns.append(tok.encode(text, add_special_tokens=False)[: rng.randint(3, 200)])
        out.append(turns)
    return out


def check_against_hf(engine: Engine, hf, n_convs=4, n_turns=3, max_tokens=24, seed=0) -> dict:
    """Run all conversations concurrently turn by turn; compare each reply with HF on the
    full context. Returns the engine counters for the caller to assert cache behaviour."""
    plan = prompts(engine, n_convs, n_turns, seed)
    contexts = [[] for _ in range(n_convs)]
    sp = SamplingParams(max_tokens=max_tokens)
    for t in range(n_turns):
        turns = [Turn(f"c{i}-{seed}", plan[i][t], sp) for i in range(n_convs)]
        results = engine.run(turns)
        for i, r in enumerate(results):
            contexts[i] += plan[i][t]
            want = hf_greedy(hf, contexts[i], max_tokens, set(engine.stop_token_ids))
            assert r.token_ids == want, f"conversation {i}, turn {t}: {r.token_ids} != {want}"
            contexts[i] += r.token_ids
        engine.cache.check()
    return engine.snapshot()["counters"]


@pytest.fixture(scope="module", params=MODELS)
def model_name(request):
    return request.param


@pytest.fixture(scope="module")
def hf(model_name, tmp_path_factory):
    engine = Engine(
        EngineConfig(model=model_name, device="cpu", gpu_cache_chunks=16, cpu_cache_chunks=0)
    )
    return hf_model(engine)


def make(model_name, **kw) -> Engine:
    return Engine(EngineConfig(model=model_name, device="cpu", **kw))


def test_gpu_mode_drops_and_recomputes(model_name, hf):
    # 12 chunks hold ~2 conversations: idle ones are dropped and recomputed from history.
    engine = make(model_name, gpu_cache_chunks=12, cache_mode="gpu")
    counters = check_against_hf(engine, hf)
    assert counters["recomputed_tokens"] > 0
    assert counters["dropped_tokens"] > 0


def test_pensieve_swaps_and_drops(model_name, hf):
    engine = make(model_name, gpu_cache_chunks=12, cpu_cache_chunks=6)
    counters = check_against_hf(engine, hf, seed=1)
    assert counters["swapped_in_tokens"] > 0
    assert counters["recomputed_tokens"] > 0
    assert counters["cached_tokens"] > 0


def test_stateless_recomputes_everything(model_name, hf):
    engine = make(model_name, gpu_cache_chunks=64, cache_mode="stateless")
    counters = check_against_hf(engine, hf, n_turns=2, seed=2)
    assert counters["cached_tokens"] == 0
    assert counters["recomputed_tokens"] > 0


def test_large_cache_keeps_everything(model_name, hf):
    engine = make(model_name, gpu_cache_chunks=256, cpu_cache_chunks=0, cache_mode="gpu")
    counters = check_against_hf(engine, hf, n_turns=3, seed=3)
    assert counters["recomputed_tokens"] == 0
    assert counters["cached_tokens"] > 0


def test_chunked_prefill_and_suspension(model_name, hf):
    # A tiny token budget splits prompts across steps; a pool this small forces suspensions.
    engine = make(model_name, gpu_cache_chunks=8, cpu_cache_chunks=32, max_batch_tokens=40)
    counters = check_against_hf(engine, hf, n_convs=4, n_turns=2, max_tokens=40, seed=4)
    assert counters["suspensions"] > 0
