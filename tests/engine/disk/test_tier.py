"""The disk tier: chunks the CPU tier drops are written to files and read back instead of
recomputed, with greedy equality with Hugging Face through every move; a restart reads
them; damaged files fall back to recompute. The first two also on models whose sliding
layers keep only their window (files hold the pages a chunk holds; where every layer slides,
no file is needed for the chunks the window left)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import Engine, EngineConfig, SamplingParams, Turn
from tests.engine.test_engine_equality import check_against_hf, prompts
from tests.oracle import hf_greedy, hf_model

MODEL = "dummy:tiny"
# five of six layers slide over 64 tokens; every layer does
MODELS = [MODEL, "dummy:tiny-gemma3", "dummy:tiny-mistral"]
_HF: dict = {}


@pytest.fixture(scope="module")
def hf():
    return hf_of(MODEL)


def hf_of(model: str):
    if model not in _HF:
        engine = Engine(EngineConfig(model=model, device="cpu", gpu_cache_chunks=16))
        _HF[model] = hf_model(engine)
    return _HF[model]


def make(disk: Path, history=None, model: str = MODEL, **kw) -> Engine:
    config = dict(device="cpu", gpu_cache_chunks=9, cpu_cache_chunks=4, max_batch_tokens=64)
    config.update(kw)
    return Engine(EngineConfig(model=model, disk_cache_dir=str(disk), **config), history=history)


def files(disk: Path) -> list[Path]:
    return sorted(disk.rglob("*.kv"))


@pytest.mark.parametrize("model", MODELS)
def test_dropped_chunks_come_back_from_disk(model, tmp_path):
    hf = hf_of(model)
    engine = make(tmp_path, model=model)
    counters = check_against_hf(
        engine, hf, max_tokens=24, seed=1, min_len=40, max_len=64, ignore_eos=True
    )
    engine.disk.flush()
    assert counters["spilled_tokens"] > 0, counters
    assert counters["disk_tokens"] > 0, counters
    assert files(tmp_path)
    snap = engine.snapshot()  # the admin page's view: a third pool, chunks on disk
    assert snap.to_dict()["pools"]["disk"]["used"] > 0
    dropped = [c for c in snap.conversations if c.chunks[0] in ("disk", "dropped")]
    assert any(c.chunks[0] == "disk" for c in dropped) or not dropped


def run_chats(engine: Engine, plan, contexts, turns: range, max_tokens: int = 12) -> list:
    """Turns `turns` of every conversation; each turn names its context's length, as the
    server does (a restarted engine learns the context from it and the history)."""
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    out = []
    for t in turns:
        results = engine.run(
            [Turn(f"c{i}", p[t], sp, context_len=len(contexts[i])) for i, p in enumerate(plan)]
        )
        for i, r in enumerate(results):
            contexts[i] += plan[i][t] + r.token_ids
        out.append(results)
    return out


@pytest.mark.parametrize("model", MODELS)
def test_a_restart_reads_the_disk_tier_instead_of_recomputing(model, tmp_path):
    hf = hf_of(model)
    first = make(tmp_path, model=model)  # keeps the history in memory: the durable one
    history = first.history
    plan = prompts(first, 3, 3, seed=5, min_len=40, max_len=64)
    contexts = [[] for _ in plan]
    run_chats(first, plan, contexts, range(2))
    first.close()  # a graceful stop writes what memory holds
    assert files(tmp_path)

    again = make(tmp_path, history, model, gpu_cache_chunks=32, cpu_cache_chunks=16)
    [results] = run_chats(again, plan, [list(c) for c in contexts], range(2, 3))
    for i, r in enumerate(results):
        want = hf_greedy(hf, contexts[i] + plan[i][2], 12, set())
        assert r.token_ids == want, f"conversation {i}"
        assert r.stats.disk_tokens > 0, r.stats
        assert r.stats.recomputed_tokens < r.stats.disk_tokens, r.stats
    again.cache.check()


@pytest.mark.parametrize("damage", ["truncate", "corrupt", "delete"])
def test_damaged_files_fall_back_to_recompute(hf, tmp_path, damage):
    first = make(tmp_path)
    history = first.history
    plan = prompts(first, 2, 3, seed=6, min_len=40, max_len=64)
    contexts = [[] for _ in plan]
    run_chats(first, plan, contexts, range(2))
    first.close()
    for path in files(tmp_path):
        data = path.read_bytes()
        if damage == "truncate":
            path.write_bytes(data[: len(data) // 2])
        elif damage == "corrupt":
            path.write_bytes(data[:-10] + bytes(10 * [0xFF]))
        else:
            path.unlink()
    again = make(tmp_path, history, gpu_cache_chunks=32, cpu_cache_chunks=16)
    [results] = run_chats(again, plan, [list(c) for c in contexts], range(2, 3))
    for i, r in enumerate(results):
        assert r.token_ids == hf_greedy(hf, contexts[i] + plan[i][2], 12, set())
        assert r.stats.disk_tokens == 0, r.stats
    assert not files(tmp_path) or damage == "delete"  # damaged files are removed


def test_erasing_a_conversation_removes_its_files(hf, tmp_path):
    engine = make(tmp_path, gpu_cache_chunks=32, cpu_cache_chunks=16)
    plan = prompts(engine, 2, 1, seed=7, min_len=40, max_len=64)
    run_chats(engine, plan, [[], []], range(1))
    assert engine.write_back() > 0
    keys = {i: list(engine.streams[f"c{i}"].hashes) for i in range(2)}
    engine.free("c0", erase=True)
    engine.free("c1")  # forgotten by the engine, kept on disk
    assert not any(engine.disk.store.has(k, j) for j, k in enumerate(keys[0]))
    assert all(engine.disk.store.has(k, j) for j, k in enumerate(keys[1]))
    engine.close()
