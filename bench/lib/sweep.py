"""The one ladder walk of a serving sweep, whatever the clock: each mode's runs up a ladder
of rates until its latency crosses the bound. A run is measured by the caller's `measure`
(the replay on a clock, `bench/lib/replay.py`: an engine in process, one on a simulated
device, a server's URL), so `bench.serve`, `bench.sim`, the GPU report's serving parts and
their rehearsals walk the same ladder."""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from typing import Any

Measure = Callable[[float], Awaitable[dict[str, Any] | None]]  # rate -> run (None: skipped)
# mode -> a context in which `measure(think, rate)` runs (an engine started for the mode)
Clock = Callable[[str], contextlib.AbstractAsyncContextManager]


def over(run: dict[str, Any], bound: float) -> bool:
    """A run the sweep goes no higher from: its mean normalized latency above the bound, or
    refused turns (more load is refused too; `crossing` leaves such a run out when it is
    under the bound)."""
    m = run["metrics"]
    return bool(m["errors"]) or not m["norm_latency_mean"] <= bound


def rungs(rates: list[float], start: int = 0, max_rate: float | None = None
          ) -> Generator[float, bool, None]:  # fmt: skip
    """The rates of one sweep: from `rates[start]`, up while under the bound, down while
    over, until an adjacent pair under/over is known or the ladder ends; under the bound at
    its last rate, twice that (up to `max_rate`). Send each run's `over` back to get the
    next rate."""
    rates = list(rates)
    seen: dict[int, bool] = {}
    i = start
    while 0 <= i < len(rates):
        seen[i] = yield rates[i]
        step = -1 if seen[i] else 1
        if i + step in seen:
            return
        if i + step == len(rates) and max_rate is not None and 2 * rates[i] <= max_rate:
            rates.append(2 * rates[i])
        i += step


async def sweep(measure: Measure, rates: list[float], bound: float, *, start: int = 0,
                max_rate: float | None = None, stop_past: float = 1.0, refine: int = 0,
                log: Callable[..., None] = lambda *a: None, name: str = "") -> list[dict]:  # fmt: skip
    """One mode's runs along `rungs` (a run over `bound x stop_past` goes no higher), until a
    run is skipped (`measure` returned None: a budget); then, once the runs cross the bound,
    the rates either side bisected (geometric mean) `refine` times."""
    runs: list[dict[str, Any]] = []
    steps = rungs(rates, start, max_rate)
    rate: float | None = next(steps)
    listed = rates[-1] if rates else 0.0
    while rate is not None:
        run = await measure(rate)
        if run is None:
            return runs
        runs.append(run)
        past = over(run, bound * stop_past)
        try:
            rate = steps.send(past)
        except StopIteration:
            rate = None
            if past and start == 0:
                log(f"{name}: past the latency bound, skipping higher rates")
        if rate is not None and rate > listed and not past:
            log(f"{name}: under the bound at {run['rate']:g}/s, going on to {rate:g}/s")
    for _ in range(refine):
        under = [r["rate"] for r in runs if not over(r, bound)]
        past_rates = [r["rate"] for r in runs if over(r, bound)]
        if not under or not past_rates or max(under) > min(past_rates):
            break
        run = await measure(math.sqrt(max(under) * min(past_rates)))
        if run is None:
            break
        runs.append(run)
    return runs


async def sweep_modes(clock: Clock, modes: list[str], thinks: list[float], rates: list[float],
                      bound: float, *, start: int = 0, carry: bool = False, **walk
                      ) -> list[dict]:  # fmt: skip
    """Every mode's sweep at every think time: `clock(mode)` holds what the mode's runs run
    on and yields its `measure(think, rate)`. `carry`: each next mode starts where this one
    was last under the bound (each next mode should serve more). `walk`: `sweep`'s own."""
    runs: list[dict[str, Any]] = []
    for mode in modes:
        got: list[dict[str, Any]] = []
        async with clock(mode) as measure:
            for think in thinks:

                async def at(rate: float, think: float = think) -> dict | None:
                    return await measure(think, rate)

                got += await sweep(at, rates, bound, start=start, name=mode, **walk)
        runs += got
        if carry:
            start = next_start(rates, got, bound, start)
    return runs


async def ladder(clock: Clock, modes: list[str], preset, refine: int = 0,
                 log: Callable[..., None] = lambda *a: None) -> list[dict]:  # fmt: skip
    """A preset's sweep (`bench.lib.presets.Preset`: its rates, think times, bound, where
    it stops and how far it doubles) of each mode on `clock`: `bench.serve` on an engine in
    process or a server, `bench.sim` in virtual time (with `refine` bisections)."""
    return await sweep_modes(clock, modes, preset.think_s, preset.rates, preset.latency_bound,
                             max_rate=preset.max_rate, stop_past=preset.stop_past_bound,
                             refine=refine, log=log)  # fmt: skip


@contextlib.asynccontextmanager
async def nothing_to_start(measure) -> AsyncIterator[Any]:
    """A clock whose mode needs nothing started: its runs are made each on their own."""
    yield measure


def next_start(ladder: list[float], runs: list[dict[str, Any]], bound: float, start: int) -> int:
    """Where the next mode's sweep starts: the rate where this one was last under (each
    next mode should serve more), else where this one started."""
    under = [x["rate"] for x in runs if not over(x, bound)]
    return start_index(ladder, max(under)) if under else start


def start_index(ladder: list[float], rate: float) -> int:
    return max([i for i, x in enumerate(ladder) if x <= rate], default=0)
