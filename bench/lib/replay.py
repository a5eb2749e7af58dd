"""One multi-turn replay on a clock: a real engine in this process (`Real`: an AsyncEngine on
the CPU or CUDA, wall time) or a simulated one (`Virtual`: an Engine on a device's cost
model, virtual time). A serving run (`serve_run`) and a run resumed from a steady state
(`steady_run`) are the same replay on either: a GPU report's part and its twin differ only
by the clock. A server's URL is the same replay through `bench.lib.drivers` (`bench.serve`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.lib import steady as st
from bench.lib import workload as wl
from bench.lib.drivers import EngineDriver
from bench.lib.metrics import turn_table, window_metrics
from bench.lib.sweep import measure
from bench.lib.virtual import replay

Run = tuple[list[wl.TurnRecord], float, dict[str, Any]]  # records, seconds, counters


class Real:
    """An AsyncEngine in this process: turns sent for `stop_s`, those still running `drain_s`
    later cancelled and counted at their lower bound (`EngineDriver`'s deadline)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def now(self) -> float:
        return self.engine.engine.now()

    @property
    def chunk_size(self) -> int:
        return self.engine.engine.cache.chunk_size

    async def clear(self) -> None:
        e = self.engine.engine
        ids = set(e.streams) | {t.id for t in e.cache.held()}
        await asyncio.gather(*(self.engine.free(cid) for cid in ids))

    async def seed(self, seeds) -> None:
        await self.engine.seed(seeds)

    async def run(self, plans, tag: str, stop_s: float, drain_s: float, temperature=0.0) -> Run:
        deadline = time.monotonic() + stop_s + drain_s
        driver = EngineDriver(self.engine, tag, temperature, deadline)
        return await measure(self.engine, driver, plans, tag, stop_s=stop_s)


class Virtual:
    """An Engine on a simulated device, cut as `Real` cuts its runs, a turn refused at a
    full queue as the AsyncEngine refuses it (`virtual.replay`)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def now(self) -> float:
        return self.engine.now()

    @property
    def chunk_size(self) -> int:
        return self.engine.cache.chunk_size

    async def clear(self) -> None:
        for cid in set(self.engine.streams) | {t.id for t in self.engine.cache.held()}:
            self.engine.free(cid)

    async def seed(self, seeds) -> None:
        self.engine.seed(seeds)

    async def run(self, plans, tag: str, stop_s: float, drain_s: float, temperature=0.0) -> Run:
        e = self.engine
        records, span = replay(e, plans, tag, 1.0, stop_s, deadline_s=stop_s + drain_s,
                               queue_limit=True)  # fmt: skip
        return records, span, asdict(e.snapshot().counters)


async def serve_run(target, plans, tag: str, mode: str, engine_mode: str, rate: float, k: float,
                    think_s: float, window: tuple[float, float], **extra) -> dict[str, Any]:  # fmt: skip
    """One serving run: `plans` sent for the window, then at most the drain (`window`);
    `extra` kept in its record (its `temperature`: the turns' sampling, else greedy)."""
    records, wall, counters = await target.run(plans, tag, *window, extra.get("temperature", 0.0))
    return {"mode": mode, "engine_mode": engine_mode, "rate": rate, "scale": k,
            "think_s": think_s, **extra, "window_s": window[0], "wall_s": wall,
            "metrics": window_metrics(records, wall), "counters": counters,
            "turns": turn_table(records)}  # fmt: skip


async def steady_run(target, s, mode: str, state: st.State, path: Path, convs) -> dict[str, Any]:
    """One run from a steady state: the engine cleared and seeded with it, its continuation
    replayed (`steady_warmup_s` sent, not counted; then `steady_window_s` counted; then at
    most `steady_drain_s` before what still runs is cut, at its lower bound)."""
    tag = f"steady-{mode}-{state.rate:g}"
    t = time.perf_counter()
    await target.clear()
    seeds, bad = st.seeds(state, convs, tag, target.now(), target.chunk_size)
    await target.seed(seeds)
    seed_s = time.perf_counter() - t
    stop = s.steady_warmup_s + s.steady_window_s
    plans = st.resume(state, convs, stop)
    records, wall, counters = await target.run(plans, tag, stop, s.steady_drain_s)
    run = st.run_row(s, mode, state, path, (len(seeds), bad), seed_s, wall, records, convs)
    run["counters"] = counters
    return run
