"""The real engine on a simulated device: its own scheduler and cache, in virtual time."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, replace

import pytest

from engine import Engine, EngineConfig, SamplingParams, Turn, calibrate
from engine.sim.cost import Fitted

MODEL = "dummy:llama-2-13b-gqa10"


def conversations(engine: Engine, n: int, turns: int, seed: int = 0) -> list[tuple]:
    """n conversations of `turns` turns, interleaved, each turn run to its end:
    (conversation, turn, output length, virtual finish time)."""
    rng = random.Random(seed)
    out = []
    for t in range(turns):
        batch = [Turn(f"c{i}", [rng.randrange(1, 30000) for _ in range(rng.randrange(200, 900))],
                      SamplingParams(max_tokens=rng.randrange(8, 40), ignore_eos=True))
                 for i in range(n)]  # fmt: skip
        for turn, res in zip(batch, engine.run(batch), strict=True):
            assert res.token_ids == [0] * turn.sampling.max_tokens
            out.append((turn.conversation_id, t, len(res.token_ids), res.stats.finish_s))
    return out


def sim_engine(**kw) -> Engine:
    cfg = dict(model=MODEL, device="sim:h100", gpu_cache_chunks=300, cpu_cache_chunks=200)
    return Engine(EngineConfig(**(cfg | kw)))


def test_a_simulated_h100_runs_the_real_cache_in_virtual_time() -> None:
    engine = sim_engine()
    out = conversations(engine, n=12, turns=3)
    c = engine.snapshot().counters
    # The tiers are too small for the history: the real cache swapped and dropped chunks.
    assert c.swapped_out_tokens > 0 and c.swapped_in_tokens > 0
    assert c.cached_tokens > 0
    engine.cache.check()
    # Virtual seconds of an H100: a 13B model decodes a token in tens of milliseconds at most
    span = engine.now()
    assert 0 < span < 0.05 * c.generated_tokens + 1.0
    assert engine.runner.steps == c.steps
    assert len(out) == 36 and all(r[3] <= span for r in out)


def test_the_same_workload_gives_the_same_virtual_times_and_counters() -> None:
    runs = []
    for _ in range(2):
        engine = sim_engine()
        runs.append((conversations(engine, n=8, turns=3), asdict(engine.snapshot().counters)))
    assert runs[0] == runs[1]


def test_smaller_tiers_recompute_more() -> None:
    big, small = sim_engine(gpu_cache_chunks=2000), sim_engine(cpu_cache_chunks=0)
    conversations(big, 8, 3)
    conversations(small, 8, 3)
    assert big.snapshot().counters.recomputed_tokens < small.snapshot().counters.recomputed_tokens
    assert big.now() < small.now()  # recompute costs virtual time


def test_an_unknown_simulated_device_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown simulated device"):
        Engine(EngineConfig(model=MODEL, device="sim:tpu"))


def test_the_cpu_device_is_calibrated_once_and_cached(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(calibrate, "PROMPTS", (32, 128))
    monkeypatch.setattr(calibrate, "BATCHES", (1, 4))
    monkeypatch.setattr(calibrate, "CONTEXTS", (64,))
    path = tmp_path / "cpu.json"  # the model's own cache stays where it is (its tokenizer)
    monkeypatch.setattr(calibrate, "_path", lambda config: path)
    cfg = EngineConfig(model="dummy:tiny", device="sim:cpu", gpu_cache_chunks=64,
                       cpu_cache_chunks=64)  # fmt: skip
    engine = Engine(cfg)
    fit = json.loads(path.read_text())
    assert fit["steps"] >= 6 and fit["swap_in_bps"] > 0
    assert len(fit["probe_s"]) == 2 and all(p > 0 for p in fit["probe_s"])
    assert isinstance(engine.backend.simulated.cost, Fitted)
    assert all(w >= 0 for w in fit["weights"]) and sum(fit["weights"]) > 0
    # The policy's Cost(l) is the one a real engine on this machine evicts by (its profile)
    real = Engine(replace(cfg, device="cpu"))
    assert engine.cache.policy.cost == real.cache.policy.cost
    real.close()
    res = engine.run(
        [Turn("a", list(range(1, 100)), SamplingParams(max_tokens=5, ignore_eos=True))]
    )
    assert res[0].token_ids == [0] * 5 and engine.now() > 0
    # A second engine reads the file instead of calibrating again.
    monkeypatch.setattr(calibrate, "calibrate", lambda *a: pytest.fail("calibrated twice"))
    Engine(cfg)


def test_the_engine_teaches_the_policy_each_turns_end_and_return() -> None:
    engine = sim_engine(eviction="returns")
    out = conversations(engine, n=8, turns=3)
    returns = engine.cache.policy.returns
    assert len(returns.gaps) == 16  # the second and third turns of each conversation
    assert 23.5 < returns.ends < 24  # 24 turn ends, decayed a little
    # a gap is the time from a turn's end to the next turn's arrival: within the run's span
    assert all(0 <= g <= engine.now() for g in returns.gaps)
    assert len(out) == 24
