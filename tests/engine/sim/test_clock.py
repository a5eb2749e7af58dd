"""The engine reads one injected clock: every stamp, activity time and prefetch wait."""

from __future__ import annotations

from engine import Engine, EngineConfig, SamplingParams, Turn
from engine.prefetch import WAIT_S
from engine.request import PrefetchEnd
from engine.sim.clock import VirtualClock


def test_stamps_and_activity_come_from_the_injected_clock() -> None:
    clock = VirtualClock(1000.0)
    engine = Engine(
        EngineConfig(model="dummy:tiny", device="cpu", gpu_cache_chunks=32, cpu_cache_chunks=8),
        now=clock,
    )
    req = engine.submit(Turn("a", list(range(1, 40)), SamplingParams(max_tokens=3)))
    steps = 0
    while engine.has_work():
        clock.advance(0.5)  # each step "takes" half a virtual second
        engine.step()
        steps += 1
    s = req.stats
    assert s.arrival_s == 1000.0
    assert s.admitted_s == 1000.5  # planned in the first step
    assert s.first_token_s == 1000.5
    assert s.finish_s == 1000.0 + 0.5 * steps
    assert engine.clock.last_active("a") == s.finish_s
    snap = engine.snapshot()
    assert snap.conversations[0].idle_s == 0.0  # idle time is virtual too


def test_a_prefetch_expires_in_virtual_time() -> None:
    """A recompute prefetch that finds no room is given up WAIT_S later on the engine's
    clock, however little wall time passed."""
    clock = VirtualClock(0.0)
    engine = Engine(
        EngineConfig(
            model="dummy:tiny",
            device="cpu",
            gpu_cache_chunks=8,
            cpu_cache_chunks=0,
            prefetch_share=0.25,  # prefetches are looked at beside running turns
        ),
        now=clock,
    )
    engine.run([Turn("a", list(range(1, 100)), SamplingParams(max_tokens=2))])
    engine.run([Turn("b", list(range(200, 400)), SamplingParams(max_tokens=2))])  # drops a's
    assert engine.cache.table("a").n_dropped
    busy = engine.submit(Turn("c", list(range(500, 700)), SamplingParams(max_tokens=50)))
    engine.step()  # c holds the GPU tier: no room for a's prefetch
    engine.prefetch("a")
    pre = engine.scheduler.prefetch.current["a"]
    clock.advance(WAIT_S + 1)
    engine.step()
    assert pre.prefetch_end is PrefetchEnd.EXPIRED
    engine.cancel(busy)
    engine.step()
