"""Where an engine's step time goes, measured on the running engine without changing it: host
time per step (wall less the wait for the sampled tokens), the device's busy share, the
copies' time and its overlap with the forward, and launches per step.

The pool and runner are wrapped for the window only (instance attributes, put back after):
CUDA events around each forward on the compute stream and each copy on the copy stream, read
against one reference event. Launches come from a short `torch.profiler` window (CUDA only).
On the CPU the device figures are None.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

# CUDA runtime and driver calls that put work on the device (kernels, graphs, copies)
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")  # fmt: skip


@dataclass
class StepProfile:
    steps: int
    wall_ms_per_step: float
    host_ms_per_step: float  # wall less the wait for sampled tokens
    device_busy_share: float | None  # forward spans (CUDA events) / wall
    copy_ms_per_step: float | None  # copy spans on the copy stream
    copy_overlap_share: float | None  # of copy time, the share inside a forward span
    launches_per_step: float | None
    launches_note: str = ""


def overlap(spans: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Time of `spans` that lies inside the union of `cover` (intervals in any order)."""
    merged: list[list[float]] = []
    for a, b in sorted(cover):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    total = 0.0
    for a, b in spans:
        for c, d in merged:
            total += max(0.0, min(b, d) - max(a, c))
    return total


class _Spans:
    """Start/end CUDA events around calls of a wrapped method, on the current stream."""

    def __init__(self, skip: Callable[..., bool] = lambda *a: False) -> None:
        self.events: list[tuple[Any, Any]] = []
        self.skip = skip

    def wrap(self, fn: Callable) -> Callable:
        def run(*a, **kw):
            if self.skip(*a):
                return fn(*a, **kw)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return fn(*a, **kw)
            finally:
                end.record()
                self.events.append((start, end))

        return run

    def read(self, ref) -> list[tuple[float, float]]:
        """(start, end) in ms after `ref` (every event is complete: the caller synchronized)."""
        return [(ref.elapsed_time(s), ref.elapsed_time(e)) for s, e in self.events]


def _patch(obj: Any, name: str, wrapper: Callable[[Callable], Callable], undo: list) -> None:
    if obj is None or not hasattr(obj, name):
        return
    had = name in vars(obj)
    undo.append((obj, name, vars(obj).get(name), had))
    setattr(obj, name, wrapper(getattr(obj, name)))


def _restore(undo: list) -> None:
    for obj, name, old, had in reversed(undo):
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


def measure_steps(engine, steps: int, profiled_steps: int = 3) -> StepProfile | None:
    """Up to `profiled_steps` steps of the engine's current work under torch.profiler for
    the launch count (CUDA), then up to `steps` steps timed (fewer if the work runs out).
    None if no step was timed."""
    cuda = engine.device.type == "cuda"
    launches, note = count_launches(engine, profiled_steps) if cuda else (None, "no device")
    pool = getattr(engine, "pool", None)
    runner = getattr(engine, "runner", None)
    undo: list = []
    waits: list[float] = []

    def timed_sampler(fn: Callable) -> Callable:
        def run(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                waits.append(time.perf_counter() - t)

        return run

    forwards = _Spans()
    copies = _Spans(skip=lambda first, *rest: not first)  # no pairs, no loads: nothing copied
    _patch(runner, "sampler", timed_sampler, undo)
    if cuda:
        _patch(runner, "run", forwards.wrap, undo)
        _patch(getattr(runner, "graphs", None), "run", forwards.wrap, undo)  # decode graphs
        for name in ("_copy_out", "_copy_in", "_load"):
            _patch(pool, name, copies.wrap, undo)
    walls: list[float] = []
    try:
        if cuda:
            torch.cuda.synchronize(engine.device)
            ref = torch.cuda.Event(enable_timing=True)
            ref.record()
        t0 = time.perf_counter()
        while len(walls) < steps and engine.has_work():
            t = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t)
        if cuda:
            torch.cuda.synchronize(engine.device)
        window_ms = (time.perf_counter() - t0) * 1e3
    finally:
        _restore(undo)
    n = len(walls)
    if not n:
        return None
    wall = sum(walls) * 1e3 / n
    host = (sum(walls) - sum(waits)) * 1e3 / n
    busy = copy_ms = share = None
    if cuda:
        fwd, cp = forwards.read(ref), copies.read(ref)
        busy = min(1.0, sum(b - a for a, b in fwd) / window_ms) if window_ms else None
        copy_total = sum(b - a for a, b in cp)
        copy_ms = copy_total / n
        share = overlap(cp, fwd) / copy_total if copy_total else None
    return StepProfile(n, wall, host, busy, copy_ms, share, launches, note)


def count_launches(engine, steps: int) -> tuple[float | None, str]:
    """Launches per step over a few steps under torch.profiler (CUDA runtime calls that put
    work on the device); None and why where the profiler cannot say."""
    from torch.profiler import ProfilerActivity, profile

    try:
        ran = 0
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            while ran < steps and engine.has_work():
                engine.step()
                ran += 1
            torch.cuda.synchronize(engine.device)
        if not ran:
            return None, "no work left to profile"
        names = [e.name for e in prof.events()]
    except Exception as e:  # noqa: BLE001 - a profiler failure must not fail the report
        return None, f"profiler failed: {e}"
    n = sum(1 for x in names if x in LAUNCH_CALLS)
    if not n:  # the profiler recorded no runtime calls: not a count of zero
        return None, f"no launch calls among {len(names)} profiler events"
    return n / ran, f"{ran} steps under torch.profiler"


def summarize(profiles: list[StepProfile]) -> dict[str, Any]:
    """Per-run profiles as one row: medians, None where no run had the figure."""

    def med(key: str) -> float | None:
        vals = [getattr(p, key) for p in profiles if getattr(p, key) is not None]
        return statistics.median(vals) if vals else None

    keys = [k for k in asdict(profiles[0]) if k not in ("steps", "launches_note")]
    return {
        "steps": sum(p.steps for p in profiles),
        **{k: med(k) for k in keys},
        "launches_note": profiles[-1].launches_note,
    }
