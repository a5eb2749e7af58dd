"""The fates of chunks copied ahead of time, as /metrics serves them."""

from __future__ import annotations

from app.metrics import Metrics
from engine.snapshot import EngineCounters, EngineSnapshot, PoolUsage


def test_swap_ahead_outcomes_are_exported() -> None:
    counters = EngineCounters(
        ahead_chunks=9, ahead_reclaimed_chunks=5, ahead_read_chunks=3, ahead_wasted_chunks=2
    )
    pool = PoolUsage(total=8, used=4, free=4)
    snap = EngineSnapshot("cpu", "dummy:tiny", 32, "pensieve", "pensieve", pool, pool,
                          counters, (), 2048)  # fmt: skip
    m = Metrics()
    m.watch(lambda: snap)
    text = m.render().decode()
    for outcome, n in (("copied", 9), ("reclaimed", 5), ("read", 3), ("wasted", 2)):
        assert f'pensieve:swap_ahead_chunks_total{{outcome="{outcome}"}} {n}.0' in text
