"""Bookkeeping time of one engine step with many idle conversations (no model, no tensors).

    python -m bench.cache_step --idle 2000

A step asks whether a turn can be admitted, grows 8 running turns (some start a new chunk,
which needs an eviction once the GPU pool is full) and plans ahead-of-time swap-outs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.lib.common import environment
from engine.cache.manager import KVCacheManager
from engine.cache.policy import CostModel, Policy
from engine.persistence import LocalClock

CS = 32


def manager(idle: int) -> tuple[KVCacheManager, list[float]]:
    """`idle` conversations of two chunks each fill the GPU pool (64 blocks to spare)."""
    t = [1000.0]
    clock = LocalClock(now=lambda: t[0])
    policy = Policy("pensieve", CostModel.linear(CS, 1 << 16), CS, clock)
    m = KVCacheManager(idle * 2 + 64, idle * 2, CS, policy, now=lambda: t[0])
    for i in range(idle):
        m.begin_step()
        table = m.table(f"c{i}")
        m.admit(table, 0, 2 * CS)
        m.release(table, 2 * CS)
        clock.touch(table.id, 900.0 + i * 0.01)
    return m, t


def step_us(idle: int, evicting: int, turns: int = 8, steps: int = 150) -> float:
    """Median microseconds of a step's bookkeeping; `evicting` of the turns start a chunk."""
    m, t = manager(idle)
    running = []
    for j in range(turns):
        m.begin_step()
        table = m.table(f"r{j}")
        m.admit(table, 0, 1)
        running.append([table, 0])
    times = []
    for _ in range(steps):
        t[0] += 0.05
        start = time.perf_counter()
        m.begin_step()
        m.can_admit(running[0][0], 10)
        for j, (table, kv_len) in enumerate(running):
            m.grow(table, kv_len, kv_len + (CS if j < evicting else 1))
        m.swap_out_ahead()
        times.append(time.perf_counter() - start)
        for j, entry in enumerate(running):
            entry[1] += CS if j < evicting else 1
    return statistics.median(times[40:]) * 1e6  # once the pool is full


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--idle", type=int, default=2000)
    args = ap.parse_args(argv)
    result = {
        "idle_conversations": args.idle,
        "step_us": {f"{k}_evictions": round(step_us(args.idle, k), 1) for k in (0, 1, 8)},
        "environment": environment("cpu"),
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
