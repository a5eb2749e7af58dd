"""One multi-turn replay on a clock: a real engine in this process (`Real`: an AsyncEngine on
the CPU or CUDA, wall time), a simulated one (`Virtual`: an Engine on a device's cost
model, virtual time) or a running server (`at_url`, through `bench.lib.drivers`). A
serving run (`serve_run`) and a run resumed from a steady state (`steady_run`) are the same
replay on either: a GPU report's part and its twin differ only by the clock. A preset's
sweep (`bench.serve`, `bench.sim`) is the one ladder walk (`bench.lib.sweep`) over the
clocks of `in_process`, `simulated` and `at_url`."""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.lib import steady as st
from bench.lib import workload as wl
from bench.lib.drivers import EngineDriver, OpenAIDriver, UrlDriver
from bench.lib.metrics import (
    counters_delta,
    run_line,
    run_record,
    steady_metrics,
    turn_table,
    window_metrics,
)
from bench.lib.pools import engine_config, for_mode
from bench.lib.presets import MODES, Preset
from bench.lib.sweep import Clock, nothing_to_start
from bench.lib.virtual import HostTime, replay
from engine import AsyncEngine, Engine
from engine.calibrate import speed_probe

Run = tuple[list[wl.TurnRecord], float, dict[str, Any]]  # records, seconds, counters


def _quiet(*a) -> None:
    pass


class Real:
    """An AsyncEngine in this process: turns sent for `stop_s`, those still running `drain_s`
    later cancelled and counted at their lower bound (`EngineDriver`'s deadline); without a
    drain every turn runs to its end."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def now(self) -> float:
        return self.engine.engine.now()

    @property
    def chunk_size(self) -> int:
        return self.engine.engine.cache.chunk_size

    @property
    def max_waiting(self) -> int | None:
        return self.engine.engine.config.max_waiting

    async def clear(self) -> None:
        e = self.engine.engine
        ids = set(e.streams) | {t.id for t in e.cache.held()}
        await asyncio.gather(*(self.engine.free(cid) for cid in ids))

    async def seed(self, seeds) -> None:
        await self.engine.seed(seeds)

    async def run(self, plans, tag: str, stop_s: float | None = None,
                  drain_s: float | None = None, temperature=0.0, time_scale: float = 1.0,
                  typing: bool = False) -> Run:  # fmt: skip
        """The run's records, wall seconds and what the engine's counters grew by; its
        conversations are freed after it. `typing`: the engine is told the plans' typing
        hints (`Plan.lead_s`)."""
        deadline = math.inf if drain_s is None else time.monotonic() + (stop_s or 0) + drain_s
        driver = EngineDriver(self.engine, tag, temperature, deadline)
        before = self.engine.snapshot().counters
        records, wall = await wall_replay(driver.send, plans, tag, time_scale, stop_s,
                                          driver.typing if typing else None)  # fmt: skip
        await asyncio.sleep(0.6)  # the loop refreshes its snapshot once idle
        counters = counters_delta(before, self.engine.snapshot().counters)
        await driver.free()
        return records, wall, counters


class Virtual:
    """An Engine on a simulated device, cut as `Real` cuts its runs, a turn refused at a
    full queue as the AsyncEngine refuses it (`virtual.replay`; `queue_limit` False: never);
    `host`: the host time of its steps, measured."""

    def __init__(self, engine, host: HostTime | None = None, queue_limit: bool = True) -> None:
        self.engine = engine
        self.host = host
        self.queue_limit = queue_limit

    def now(self) -> float:
        return self.engine.now()

    @property
    def chunk_size(self) -> int:
        return self.engine.cache.chunk_size

    @property
    def max_waiting(self) -> int | None:
        return self.engine.config.max_waiting

    async def clear(self) -> None:
        for cid in set(self.engine.streams) | {t.id for t in self.engine.cache.held()}:
            self.engine.free(cid)

    async def seed(self, seeds) -> None:
        self.engine.seed(seeds)

    async def run(self, plans, tag: str, stop_s: float | None = None,
                  drain_s: float | None = None, temperature=0.0, time_scale: float = 1.0,
                  typing: bool = False) -> Run:  # fmt: skip
        e = self.engine
        deadline = None if drain_s is None else (stop_s or 0) + drain_s
        records, span = replay(e, plans, tag, time_scale, stop_s, self.host, deadline_s=deadline,
                               queue_limit=self.queue_limit, typing=typing)  # fmt: skip
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


# ---- a preset's sweep on each clock -----------------------------------------------------------


def plan(convs: list[wl.Conversation], rate: float, think: float, time_scale: float, seed: int):
    """Arrivals at `rate` per real second; time_scale compresses the think times replayed."""
    return wl.plan(convs, rate * time_scale, think, seed)


def in_process(preset: Preset, convs, log=_quiet, on_run=None) -> Clock:
    """A preset's runs on an AsyncEngine in this process, one per mode (its disk tier
    emptied before each run: no run finds another's chunks); on the CPU the machine's
    speed before and after each run (`probe_s`: drifting?). `on_run(run)` after each."""

    @contextlib.asynccontextmanager
    async def clock(name: str):
        mode = MODES[name]
        engine = AsyncEngine(engine_config(for_mode(preset, mode, convs), mode))
        await engine.start()

        async def measure(think: float, rate: float) -> dict[str, Any]:
            if engine.engine.disk is not None:
                engine.engine.disk.clear()
            plans = plan(convs, rate, think, preset.time_scale, preset.seed)
            before = speed_probe() if preset.device == "cpu" else None
            records, wall, counters = await Real(engine).run(
                plans, f"{name}-{think:g}-{rate:g}", time_scale=preset.time_scale
            )
            extra: dict[str, Any] = {"counters": counters}
            if before is not None:
                extra["probe_s"] = [before, speed_probe()]
            run = run_record(name, think, rate, records, wall, extra)
            log(run_line(run))
            if on_run is not None:
                on_run(run)
            return run

        try:
            yield measure
        finally:
            await engine.stop()

    return clock


def simulated(preset: Preset, convs, log=_quiet) -> Clock:
    """A preset's runs in virtual time (`preset.device` a `sim:` one), each on an engine of
    its own. With `preset.arrival_s`, the sample repeated arrives for that long and the
    steady state after the warm-up is measured."""

    async def measure(name: str, think: float, rate: float) -> dict[str, Any]:
        mode, these, stop = MODES[name], convs, None
        if preset.arrival_s is not None:
            these = [st.nth(convs, k) for k in range(max(len(convs), math.ceil(rate * preset.arrival_s)))]  # fmt: skip
        plans = plan(these, rate, think, preset.time_scale, preset.seed)
        if preset.arrival_s is not None:
            stop = max(p.arrival_s for p in plans) * preset.time_scale
        engine = Engine(engine_config(for_mode(preset, mode, these), mode))
        host = HostTime()
        t = time.perf_counter()
        try:
            records, span, counters = await Virtual(engine, host, queue_limit=False).run(
                plans, name, stop, time_scale=preset.time_scale
            )
        finally:
            engine.close()
        extra = {"counters": counters, "host": host.summary(), "real_s": time.perf_counter() - t,
                 "conversations": len(these)}  # fmt: skip
        if engine.disk is not None:  # its writes, reads, dropped writes and evictions
            extra["disk"] = engine.disk.stats()
        run = run_record(name, think, rate, records, span, extra)
        if stop is not None:
            run["metrics_whole"] = run["metrics"]
            run["metrics"] = steady_metrics(records, preset.warmup * stop, stop)
        log(run_line(run) + f"  [{len(these)} conversations, {run['real_s']:.0f}s real]")
        return run

    return lambda name: nothing_to_start(lambda think, rate: measure(name, think, rate))


def at_url(preset: Preset, convs, url: str, token: str, api: str = "ws", log=_quiet) -> Clock:
    """A preset's runs against a running server: its WebSocket (conversations made over
    REST) or its OpenAI API (`api="openai"`: each turn resends the whole chat)."""

    async def measure(name: str, think: float, rate: float) -> dict[str, Any]:
        driver = OpenAIDriver(url, token) if api == "openai" else UrlDriver(url, token)
        plans = plan(convs, rate, think, preset.time_scale, preset.seed)
        try:
            records, wall = await wall_replay(driver.send, plans, f"{name} rate {rate:g}",
                                              preset.time_scale)  # fmt: skip
        finally:
            await driver.close()
        run = run_record(name, think, rate, records, wall, {"url": url, "api": api})
        log(run_line(run))
        return run

    return lambda name: nothing_to_start(lambda think, rate: measure(name, think, rate))


# ---- the replay on the wall clock --------------------------------------------------------------


async def wall_replay(send: wl.SendFn, plans: list[wl.Plan], desc: str, time_scale: float = 1.0,
                      stop_s: float | None = None, typing=None) -> tuple[list[wl.TurnRecord], float]:  # fmt: skip
    """The plans replayed through `send`, with a progress bar: turn records, wall seconds."""
    bar = _bar(sum(len(p.conversation.turns) for p in plans), desc)
    start = time.monotonic()
    records = await wl.replay(plans, send, time_scale=time_scale, stop_s=stop_s,
                              on_turn=lambda _: bar.update(1), typing=typing)  # fmt: skip
    bar.close()
    return records, time.monotonic() - start


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _bar(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # a bare GPU box may lack it; the bar is only a nicety
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="turn", leave=False, disable=None, file=sys.stderr)
