"""The GPU report's serving parts (`bench.gpu_report`), each a list of runs of the one replay
(`bench.lib.replay`) on an AsyncEngine in this process: serve (each mode's sweep, scaled),
extra (unscaled, sampled, lru and the oracle at pensieve's capacity) and steady (runs
resumed from the simulator's steady states, unscaled)."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from bench.lib import workload as wl
from bench.lib.common import ROOT
from bench.lib.gpu_settings import (
    SERVE_MODES,
    Settings,
    load_sample,
    no_room,
    oracle_chunks,
    preset_for,
    steady_modes,
    window_of,
)
from bench.lib.metrics import crossing, run_line
from bench.lib.pools import engine_config, history_chunks, kv_bytes_per_chunk
from bench.lib.presets import MODES, Preset
from bench.lib.replay import Real, serve_run, steady_run
from bench.lib.sweep import Clock, nothing_to_start, start_index, sweep, sweep_modes
from bench.sim_steady import steady_folder
from engine import AsyncEngine, SamplingParams, Turn


def _log(*a) -> None:
    print(*a, flush=True)


WARM_PROMPTS = (64, 512, 2048)  # tokens: the prompts `warm_up` sends together


async def warm_up(engine) -> None:
    """A few turns of a few prompt lengths, decoded together and forgotten before any window:
    a fresh engine's first steps build kernels and capture graphs, which a window must not
    time (at 4e07f94 each mode's first run, at 12/s, took more per step than its second at
    16/s with more rows: 28.7 vs 26.4 ms stateless, 24.8 vs 23.7 gpu, 25.5 vs 25.3 pensieve)."""
    gen = random.Random(0)
    e = engine.engine
    longest = max(1, e.context_limit // 2)
    sampling = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    turns = [Turn(f"warm-up-{i}", [gen.randrange(e.args.vocab_size) for _ in range(min(n, longest))],
                  sampling) for i, n in enumerate(WARM_PROMPTS)]  # fmt: skip
    await asyncio.gather(*(engine.generate(t) for t in turns))
    await asyncio.gather(*(engine.free(t.conversation_id) for t in turns))


class OnDevice:
    """A part's engines on this machine's device, timed by the wall clock: one AsyncEngine per
    mode and tiers, started, warmed up and reused by that mode's runs (each frees its own
    conversations); a part's rehearsal (`Rehearsed`) runs the same part in virtual time."""

    def __init__(self, s: Settings, deadline: float) -> None:
        self.s, self.deadline = s, deadline
        self.engines: dict[tuple, Any] = {}
        self.starts: dict[str, float] = {}  # seconds each mode's engine took to start

    def left(self) -> float:
        """Seconds left of the part's budget."""
        return self.deadline - time.monotonic()

    def room(self, gpu_chunks: int, cpu_chunks: int) -> str | None:
        return no_room(self.s, gpu_chunks, cpu_chunks)

    async def target(self, mode: str, preset: Preset) -> Real:
        key = (mode, preset.gpu_cache_chunks, preset.cpu_cache_chunks)
        if key not in self.engines:
            await self.close()  # one engine at a time: each holds the weights and its pool
            t = time.monotonic()
            engine = AsyncEngine(engine_config(preset, MODES[mode]))
            await engine.start()
            self.starts[mode] = time.monotonic() - t
            _log(f"{mode}: engine started in {self.starts[mode]:.1f} s")
            await warm_up(engine)
            self.engines[key] = engine
        return Real(self.engines[key])

    def ran(self, run: dict[str, Any], longest_s: float) -> None:
        pass

    async def close(self) -> None:
        for e in self.engines.values():
            await e.stop()
        self.engines.clear()


class Runner:
    """A part's serving runs on its engines (`OnDevice` or `Rehearsed`): each run skipped,
    and listed, where it would end past the part's budget or its tiers do not fit."""

    def __init__(self, s: Settings, convs: list[wl.Conversation], engines) -> None:
        self.s, self.convs, self.engines = s, convs, engines
        self.skipped: list[str] = []

    def fits(self, seconds: float, what: str) -> bool:
        if self.engines.left() > seconds + 15:
            return True
        self.skipped.append(f"{what}: part budget")
        _log(f"skip {what}: it would not finish within the part's budget")
        return False

    async def run(
        self,
        mode: str,
        rate: float,
        k: float,
        oracle: int | None = None,
        label: str = "",
        temperature: float = 0.0,
    ) -> dict[str, Any] | None:
        s = self.s
        window, drain = window_of(s, k)
        name = label or mode
        if not self.fits(window + drain, f"{name} at {rate:g}/s (k={k:g})"):
            return None
        preset = preset_for(s, k, oracle)
        cpu = preset.cpu_cache_chunks if MODES[mode].cache_mode == "pensieve" else 0
        # The oracle near saturation, the unscaled second tier on a small host: skipped,
        # with the sizes, rather than ending the part when the allocation fails.
        if why := self.engines.room(preset.gpu_cache_chunks, cpu):
            self.skipped.append(f"{name} at {rate:g}/s (k={k:g}): {why}")
            _log(f"skip {name} at {rate:g}/s: {why}")
            return None
        target = await self.engines.target(mode, preset)
        plans = wl.plan(self.convs, rate, s.think_s / k, 0)
        run = await serve_run(target, plans, f"{name}-{k:g}-{rate:g}", name, mode, rate, k,
                              s.think_s, (window, drain),
                              think_replayed_s=s.think_s / k, temperature=temperature,
                              gpu_cache_chunks=preset.gpu_cache_chunks,
                              cpu_cache_chunks=preset.cpu_cache_chunks,
                              # its twin refuses as it did
                              max_waiting=target.max_waiting)  # fmt: skip
        self.engines.ran(run, window + drain)
        _log(run_line(run) + f" cut {run['metrics']['cancelled_at_drain']} k={k:g}")
        return run

    def clock(self, k: float) -> Clock:
        """Each mode's runs at scale `k` (`bench.lib.sweep`)."""
        return lambda mode: nothing_to_start(lambda think, rate: self.run(mode, rate, k))


async def part_serve(s: Settings, budget: float, previous: dict | None,
                     engines=None) -> dict[str, Any]:  # fmt: skip
    """Each mode's sweep on the scaled replay, from `start_rate` (each next mode from where the
    previous was last under the bound)."""
    convs, info = load_sample(s)
    engines = engines or OnDevice(s, budget)
    r = Runner(s, convs, engines)
    try:
        runs = await sweep_modes(r.clock(s.scale), list(SERVE_MODES), [s.think_s], s.rates,
                                 s.bound, start=start_index(s.rates, s.start_rate), carry=True)  # fmt: skip
    finally:
        await engines.close()
    return _serve_result(s, info, runs, r.skipped, convs)


def _serve_result(s, info, runs, skipped, convs) -> dict[str, Any]:
    per = kv_bytes_per_chunk(s.model, s.dtype)
    return {
        "workload": {k: v for k, v in info.items() if k != "parse"},
        "history_chunks": history_chunks(convs),
        "bytes_per_chunk": per,
        "runs": runs,
        "skipped": skipped,
        "capacity": {
            m: crossing([x for x in runs if x["mode"] == m], s.bound)
            for m in dict.fromkeys(x["mode"] for x in runs)
        },
        "capacity_p90": {
            m: crossing([x for x in runs if x["mode"] == m], s.bound, "norm_latency_p90")
            for m in dict.fromkeys(x["mode"] for x in runs)
        },
    }


async def part_extra(s: Settings, budget: float, previous: dict | None,
                     engines=None) -> dict[str, Any]:  # fmt: skip
    """At pensieve's last rate under the bound (from the serve part): the same run unscaled,
    with lru eviction, and the oracle's sweep from there."""
    convs, info = load_sample(s)
    serve_runs = (previous or {}).get("serve", {}).get("runs", [])
    cap = crossing([x for x in serve_runs if x["mode"] == "pensieve"], s.bound)
    rate = cap.get("under_rate") or s.start_rate
    top = next((x for x in s.rates if x > rate), rate)  # the oracle's sweep may go one up
    oracle = oracle_chunks(s, convs, top)
    engines = engines or OnDevice(s, budget)
    r = Runner(s, convs, engines)
    runs: list[dict[str, Any]] = []
    try:
        for label, k in (("pensieve", s.scale), ("pensieve-lru", s.scale)):
            mode = "pensieve-lru" if label == "pensieve-lru" else "pensieve"
            if label == "pensieve" and any(
                x["mode"] == "pensieve" and x["rate"] == rate for x in serve_runs
            ):
                runs.append(
                    next(x for x in serve_runs if x["mode"] == "pensieve" and x["rate"] == rate)
                )
                continue  # the serve part's run at this rate is the scaled one
            got = await r.run(mode, rate, k, label=label)
            runs += [got] if got else []
        got = await r.run("pensieve", rate, s.scale, label="pensieve-sampled", temperature=1.0)
        runs += [got] if got else []
        got = await r.run("pensieve", rate, 1.0, label="pensieve-unscaled")
        runs += [got] if got else []

        async def oracle_at(x: float) -> dict[str, Any] | None:
            return await r.run("pensieve", x, s.scale, oracle, "oracle")

        runs += await sweep(oracle_at, s.rates, s.bound,
                            start=s.rates.index(rate) if rate in s.rates else 0)  # fmt: skip
    finally:
        await engines.close()
    out = _serve_result(s, info, runs, r.skipped, convs)
    out["rate"] = rate
    out["oracle_chunks"] = oracle
    by = {x["mode"]: x["metrics"] for x in runs if x["rate"] == rate}
    p, lru, un = by.get("pensieve"), by.get("pensieve-lru"), by.get("pensieve-unscaled")
    sampled = by.get("pensieve-sampled")
    if p and sampled:  # the goal: temperature 1.0 within 3% of greedy
        out["sampled_vs_greedy"] = {
            key: {
                "greedy": p[key],
                "sampled": sampled[key],
                "ratio": sampled[key] / p[key] if p[key] else None,
            }
            for key in ("norm_latency_mean", "throughput_tps")
        }
    if p and lru:
        out["eviction"] = {
            "pensieve_recomputed": p["recomputed_tokens"],
            "lru_recomputed": lru["recomputed_tokens"],
            "fewer_recomputed": 1 - p["recomputed_tokens"] / lru["recomputed_tokens"]
            if lru["recomputed_tokens"]
            else None,
        }
    if p and un:
        out["scaled_vs_unscaled"] = {
            key: {
                "scaled": p[key],
                "unscaled": un[key],
                "ratio": p[key] / un[key] if un[key] else None,
            }
            for key in ("norm_latency_mean", "norm_latency_p90", "throughput_rps")
        }
    return out


async def part_steady(s: Settings, budget: float, previous: dict | None,
                      engines=None) -> dict[str, Any]:  # fmt: skip
    """The paper's setting unscaled on one GPU, in its steady state: per rate of
    `steady_rates` (a pair that brackets the bound, chosen beforehand by the simulator) the
    mode's engine cleared, seeded with the state the simulator wrote at the end of its
    warm-up at that rate, and its continuation replayed (`steady_run`). A mode whose tiers do
    not fit this machine (the oracle) or whose states are missing is skipped and listed."""
    convs, info = load_sample(s)
    folder = steady_folder(s, convs)
    engines = engines or OnDevice(s, budget)
    r = Runner(s, convs, engines)
    runs: list[dict[str, Any]] = []
    todo, skipped = steady_modes(s, convs, folder, engines.room, _log)
    run_s = s.steady_warmup_s + s.steady_window_s + s.steady_drain_s
    try:
        for mode, preset, states in todo:  # tiers sized for the mode's highest rate
            for rate, path, state in states:
                if not r.fits(run_s, f"{mode} at {rate:g}/s"):
                    continue
                try:
                    target = await engines.target(mode, preset)
                    run = await steady_run(target, s, mode, state, path, convs)
                except Exception as e:  # the loan goes on with the next run: listed
                    r.skipped.append(f"{mode} at {rate:g}/s: failed: {type(e).__name__}: {e}")
                    _log(r.skipped[-1])
                    continue
                engines.ran(run, run_s)
                _log(run_line(run) + f" cut {run['metrics']['cancelled_at_drain']} seeded "
                     f"{run['seeded']} in {run['seed_s']:.1f} s")  # fmt: skip
                runs.append(run)
    finally:
        await engines.close()
    out = _serve_result(s, info, runs, skipped + r.skipped, convs)
    out.pop("history_chunks")  # the whole sample's: not what the steady tiers hold
    out["engine_start_s"] = engines.starts
    out["states"] = str(folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder)
    return out
