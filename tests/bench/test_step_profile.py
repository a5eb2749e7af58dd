"""The step profiler's arithmetic, and that it leaves the engine as it found it."""

from __future__ import annotations

from bench.lib.step_profile import measure_steps, overlap, summarize
from engine import Engine, EngineConfig, SamplingParams, Turn


def test_overlap_counts_copy_time_inside_the_forward_spans() -> None:
    forwards = [(0.0, 4.0), (3.0, 6.0), (10.0, 12.0)]  # overlapping spans are merged
    assert overlap([(5.0, 11.0)], forwards) == 2.0  # [5, 6] and [10, 11]
    assert overlap([(1.0, 2.0), (6.0, 10.0)], forwards) == 1.0
    assert overlap([(0.0, 1.0)], []) == 0.0


def test_measure_steps_on_the_cpu_restores_the_engine() -> None:
    e = Engine(EngineConfig(model="dummy:tiny", device="cpu", gpu_cache_chunks=16))
    try:
        sampler = e.runner.sampler
        e.submit(Turn("a", list(range(1, 40)), SamplingParams(max_tokens=4, ignore_eos=True)))
        p = measure_steps(e, steps=3)
        assert p is not None and p.steps == 3 and 0 < p.host_ms_per_step <= p.wall_ms_per_step
        assert p.device_busy_share is None and p.launches_per_step is None  # no device
        assert e.runner.sampler is sampler and "run" not in vars(e.runner)
        row = summarize([p, p])
        assert row["steps"] == 6 and row["wall_ms_per_step"] == p.wall_ms_per_step
        assert measure_steps(e, steps=100) is not None and not e.has_work()
        assert measure_steps(e, steps=5) is None  # nothing left to run
    finally:
        e.close()
