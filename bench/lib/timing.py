"""Timing a callable on its device: the median of eager calls (CUDA events on a GPU, the host
clock elsewhere) and the median device time per call replayed from a CUDA graph."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from bench.lib.common import environment, git_commit

GRAPH_REPS = 10  # calls per captured graph


def _event_ms(fn: Callable[[], object], iters: int) -> float:
    """Median milliseconds of fn between two CUDA events."""
    runs = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end))
    return statistics.median(runs)


def eager_ms(fn: Callable[[], object], iters: int, cuda: bool, warmup: int = 3) -> float:
    """Median milliseconds of one call of fn (host launch included) after `warmup` calls."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
        return _event_ms(fn, iters)
    runs = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t) * 1e3)
    return statistics.median(runs)


def graph_ms(fn: Callable[[], object], iters: int) -> float:
    """Median device milliseconds per call of fn, replayed from a CUDA graph holding
    GRAPH_REPS calls: no host launch cost, only the kernels and the gaps between them.
    fn must allocate little (every call's allocations stay alive with the graph)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles, caches) outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_REPS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    ms = _event_ms(graph.replay, iters) / GRAPH_REPS
    del graph
    return ms


def header(name: str, device, dtype: str, iters: int, **extra) -> dict:
    """What a kernel benchmark's JSON opens with: the device, versions, commit and timing."""
    import triton

    return {
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": git_commit(),
        "environment": environment(device),
        "dtype": dtype,
        **extra,
        "iters": iters,
        "graph_reps": GRAPH_REPS,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
