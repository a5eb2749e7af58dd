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
    steady_config,
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


class Runner:
    """One AsyncEngine per (mode, scale, tiers); runs windows of the replay on it."""

    def __init__(self, s: Settings, convs: list[wl.Conversation], budget: float) -> None:
        self.s, self.convs, self.budget = s, convs, budget
        self.engines: dict[tuple, Any] = {}
        self.skipped: list[str] = []

    def fits(self, window: float, drain: float) -> bool:
        return time.monotonic() + window + drain + 15 < self.budget

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
        if not self.fits(window, drain):
            self.skipped.append(f"{name} at {rate:g}/s (k={k:g}): part budget")
            _log(f"skip {name} at {rate:g}/s: it would not finish within the part's budget")
            return None
        preset = preset_for(s, k, oracle)
        cpu = preset.cpu_cache_chunks if MODES[mode].cache_mode == "pensieve" else 0
        # The oracle near saturation, the unscaled second tier on a small host: skipped,
        # with the sizes, rather than ending the part when the allocation fails.
        if why := no_room(s, preset.gpu_cache_chunks, cpu):
            self.skipped.append(f"{name} at {rate:g}/s (k={k:g}): {why}")
            _log(f"skip {name} at {rate:g}/s: {why}")
            return None
        engine = await self._engine(mode, preset)
        plans = wl.plan(self.convs, rate, s.think_s / k, 0)
        run = await serve_run(Real(engine), plans, f"{name}-{k:g}-{rate:g}", name, mode, rate, k,
                              s.think_s, (window, drain),
                              think_replayed_s=s.think_s / k, temperature=temperature,
                              gpu_cache_chunks=preset.gpu_cache_chunks,
                              cpu_cache_chunks=preset.cpu_cache_chunks,
                              # its twin refuses as it did
                              max_waiting=engine.engine.config.max_waiting)  # fmt: skip
        _log(run_line(run) + f" cut {run['metrics']['cancelled_at_drain']} k={k:g}")
        return run

    def clock(self, k: float) -> Clock:
        """Each mode's runs at scale `k` (`bench.lib.sweep`)."""
        return lambda mode: nothing_to_start(lambda think, rate: self.run(mode, rate, k))

    async def _engine(self, mode: str, preset: Preset):
        """The engine of `mode` with these tiers; runs of other labels (a sampled run) reuse
        it: each run frees its own conversations."""

        key = (mode, preset.gpu_cache_chunks, preset.cpu_cache_chunks)
        if key not in self.engines:
            await self.close()  # one engine at a time: each holds the weights and its pool
            engine = AsyncEngine(engine_config(preset, MODES[mode]))
            await engine.start()
            await warm_up(engine)
            self.engines[key] = engine
        return self.engines[key]

    async def close(self) -> None:
        for e in self.engines.values():
            await e.stop()
        self.engines.clear()


async def part_serve(s: Settings, budget: float, previous: dict | None) -> dict[str, Any]:
    convs, info = load_sample(s)
    r = Runner(s, convs, budget)
    try:
        runs = await sweep_modes(r.clock(s.scale), list(SERVE_MODES), [s.think_s], s.rates,
                                 s.bound, start=start_index(s.rates, s.start_rate), carry=True)  # fmt: skip
    finally:
        await r.close()
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


async def part_extra(s: Settings, budget: float, previous: dict | None) -> dict[str, Any]:
    """At pensieve's last rate under the bound (from the serve part): the same run unscaled,
    with lru eviction, and the oracle's sweep from there."""
    convs, info = load_sample(s)
    serve_runs = (previous or {}).get("serve", {}).get("runs", [])
    cap = crossing([x for x in serve_runs if x["mode"] == "pensieve"], s.bound)
    rate = cap.get("under_rate") or s.start_rate
    top = next((x for x in s.rates if x > rate), rate)  # the oracle's sweep may go one up
    oracle = oracle_chunks(s, convs, top)
    r = Runner(s, convs, budget)
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
        await r.close()
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


async def part_steady(s: Settings, budget: float, previous: dict | None) -> dict[str, Any]:
    """The paper's setting unscaled on one GPU, in its steady state: per mode one engine;
    per rate of `steady_rates` (a pair that brackets the bound, chosen beforehand by the
    simulator) the engine cleared, seeded with the state the simulator wrote at the end of
    its warm-up at that rate, and its continuation replayed (`steady_run`). A mode whose
    tiers do not fit this machine (the oracle) or whose states are missing is skipped and
    listed."""
    convs, info = load_sample(s)
    folder = steady_folder(s, convs)
    runs: list[dict[str, Any]] = []
    starts: dict[str, float] = {}
    todo, skipped = steady_modes(s, convs, folder, no_room, _log)
    run_s = s.steady_warmup_s + s.steady_window_s + s.steady_drain_s
    for mode, preset, states in todo:
        if time.monotonic() + run_s + 15 >= budget:
            skipped += [f"{mode} at {r:g}/s: part budget" for r, _, _ in states]
            continue
        t = time.monotonic()
        engine = AsyncEngine(steady_config(s, mode, preset))
        await engine.start()
        starts[mode] = time.monotonic() - t
        _log(f"{mode}: engine started in {starts[mode]:.1f} s")
        try:
            for rate, path, state in states:
                if time.monotonic() + run_s + 15 >= budget:
                    skipped.append(f"{mode} at {rate:g}/s: part budget")
                    _log(f"skip {mode} at {rate:g}/s: it would not finish within the budget")
                    continue
                try:
                    run = await steady_run(Real(engine), s, mode, state, path, convs)
                    _log(run_line(run) + f" cut {run['metrics']['cancelled_at_drain']} seeded "
                         f"{run['seeded']} in {run['seed_s']:.1f} s")  # fmt: skip
                    runs.append(run)
                except Exception as e:  # the loan goes on with the next run: listed
                    log_exc = f"{mode} at {rate:g}/s: failed: {type(e).__name__}: {e}"
                    skipped.append(log_exc)
                    _log(log_exc)
        finally:
            await engine.stop()
    out = _serve_result(s, info, runs, skipped, convs)
    out.pop("history_chunks")  # the whole sample's: not what the steady tiers hold
    out["engine_start_s"] = starts
    out["states"] = str(folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder)
    return out
