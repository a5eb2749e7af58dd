"""One measured run of the replay at a rate, and how a sweep picks its next rate."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Generator
from typing import Any

from bench.lib import workload as wl
from bench.lib.metrics import counters_delta


async def replay(
    send: wl.SendFn,
    plans: list[wl.Plan],
    desc: str,
    time_scale: float = 1.0,
    stop_s: float | None = None,
) -> tuple[list[wl.TurnRecord], float]:
    """The plans replayed through `send`, with a progress bar: turn records, wall seconds."""
    bar = _bar(sum(len(p.conversation.turns) for p in plans), desc)
    start = time.monotonic()
    records = await wl.replay(
        plans, send, time_scale=time_scale, stop_s=stop_s, on_turn=lambda _: bar.update(1)
    )
    bar.close()
    return records, time.monotonic() - start


async def measure(
    engine, driver, plans: list[wl.Plan], desc: str, time_scale: float = 1.0, stop_s=None
) -> tuple[list[wl.TurnRecord], float, dict[str, Any]]:
    """A run on an in-process engine: its records, wall seconds and what the engine's
    counters grew by; the run's conversations are freed after it."""
    before = engine.snapshot().counters
    records, wall = await replay(driver.send, plans, desc, time_scale, stop_s)
    await asyncio.sleep(0.6)  # the loop refreshes its snapshot once idle
    counters = counters_delta(before, engine.snapshot().counters)
    await driver.free()
    return records, wall, counters


def plan(convs: list[wl.Conversation], rate: float, think: float, time_scale: float, seed: int):
    """Arrivals at `rate` per real second; time_scale compresses the think times replayed."""
    return wl.plan(convs, rate * time_scale, think, seed)


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


def ladder(preset, mode: str, log) -> Generator[float, dict[str, Any], None]:
    """The rates of one mode's sweep at one think time: the preset's, then doubling (up to
    max_rate) while under the bound; it stops once a run is past bound x stop_past_bound.
    Send each run back (`then`) to get the next rate."""
    rates = list(preset.rates)
    for rate in rates:
        run = yield rate
        if over(run, preset.latency_bound * preset.stop_past_bound):
            log(f"{mode}: past the latency bound, skipping higher rates")
            return
        nxt = next_rate(rates, rate, preset.max_rate)
        if nxt is not None:
            log(f"{mode}: under the bound at {rate:g}/s, going on to {nxt:g}/s")
            rates.append(nxt)


def then(rates: Generator[float, dict[str, Any], None], run: dict[str, Any]) -> float | None:
    """The ladder's next rate after `run`, or None: the sweep is over."""
    try:
        return rates.send(run)
    except StopIteration:
        return None


def next_rate(rates: list[float], rate: float, max_rate: float | None) -> float | None:
    """After the last listed rate of a sweep still under the bound: twice it, up to max_rate."""
    if rate != rates[-1] or max_rate is None or 2 * rate > max_rate:
        return None
    return 2 * rate


def over(run: dict[str, Any], bound: float) -> bool:
    """A run the sweep goes no higher from: its mean normalized latency above the bound, or
    refused turns (more load is refused too; `crossing` leaves such a run out when it is
    under the bound)."""
    m = run["metrics"]
    return bool(m["errors"]) or not m["norm_latency_mean"] <= bound


def walk(n: int, start: int) -> Generator[int, bool, None]:
    """The ladder indices of one sweep: from `start`, up while under the bound, down while
    over, until an adjacent pair under/over is known (or the ladder ends). Send each run's
    `over` back to get the next index (`bench.sim.serve_part` walks it in virtual time)."""
    seen: dict[int, bool] = {}
    i = start
    while 0 <= i < n:
        seen[i] = yield i
        step = -1 if seen[i] else 1
        if i + step in seen:
            return
        i += step


def next_start(ladder: list[float], runs: list[dict[str, Any]], bound: float, start: int) -> int:
    """Where the next mode's sweep starts: the rate where this one was last under (each
    next mode should serve more), else where this one started."""
    under = [x["rate"] for x in runs if not over(x, bound)]
    return start_index(ladder, max(under)) if under else start


def next_index(steps: Generator[int, bool, None], was_over: bool) -> int | None:
    """The walk's next index after a run (None: the sweep is done)."""
    try:
        return steps.send(was_over)
    except StopIteration:
        return None


def start_index(ladder: list[float], rate: float) -> int:
    return max([i for i, x in enumerate(ladder) if x <= rate], default=0)
