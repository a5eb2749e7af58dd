"""The GPU report: prefill MFU, the decode roofline and serving capacity, in one command.

    python -m bench.gpu_report                        # every part, about 31 min on an H100
    python -m bench.gpu_report --part mfu,decode      # about 5 min
    python -m bench.gpu_report --part serve           # about 7.5 min: the capacity sweep
    python -m bench.gpu_report --part extra           # at most 9 min: unscaled check, oracle, lru
    python -m bench.gpu_report --part steady          # at most 8 min: the steady state, unscaled
    python -m bench.gpu_report --device cpu --model dummy:tiny   # dry run of every part

Everything runs in this process on the engine (no server, no web stack), on dummy weights
of the 13B-GQA10 shape, replaying the committed ShareGPT sample, so a bare GPU machine
without network needs only the tree. Parts run separately merge into the same
`bench/results/gpu-report-<device>.json`; each part stops starting runs that would not
finish within its budget (`--budget`) and records what it skipped.

- mfu: `bench.mfu` at 512, 2k and 8k prompt tokens.
- profile: per mode at one load, host ms per step, the device's busy share, copy time and
  its overlap with the forward, launches per step; the copy rates of scattered chunks per
  direction through the block-copy kernel and the copy engine (about a minute).
- decode: the step time of decode-only batches (CUDA events, median of repeats) against
  the time to read the weights and the batch's KV once at the HBM bandwidth measured by a
  large device copy; then the same of a mixture-of-experts shape (Qwen3-30B-A3B, batches
  1 and 64 at 1k context, about 30 s), whose roofline counts the weights a step reads:
  attention, router and the experts its batch touches (expected under uniform routing).
- serve: pensieve, gpu-only and stateless; Poisson arrivals, exponential think time (mean
  60 s) replayed scaled: think time / k and both tiers / k. Each run sends turns for
  `--window` seconds, then waits at most `--drain` seconds and cancels what still runs
  (counted with its latency so far: a lower bound). Capacity = the throughput where the
  mean normalized latency reaches 180 ms/token (`bench.lib.metrics.crossing`).
- extra: one rate both unscaled (k = 1, a longer window) and scaled, the same run sampled at
  temperature 1.0 (the goal: within 3% of greedy), the oracle (tiers that never evict) and
  pensieve's eviction against lru on the same run.
- steady: the paper's setting unscaled (40 GiB GPU tier, a CPU tier as large as a lent
  machine allows, think time 60 s), each mode at a pair of rates that brackets the bound,
  chosen beforehand by the simulator; each run seeded with the state the simulator wrote
  at the end of a 20-minute warm-up at its rate (`bench/lib/steady.py`), then a short
  warm-up, then a 45 s window. The oracle where its tiers fit (on a lent machine they do not).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench import mfu
from bench.lib import steady as st
from bench.lib import workload as wl
from bench.lib.common import RESULTS, ROOT, device_slug, environment
from bench.lib.drivers import EngineDriver
from bench.lib.gpu_settings import (
    SERVE_MODES,
    STEADY_MODES,
    Settings,
    dry_settings,
    experts_touched,
    load_sample,
    no_room,
    oracle_chunks,
    preset_for,
    state_mismatch,
    steady_config,
    steady_preset,
    steady_states,
    weight_bytes,
    window_of,
)
from bench.lib.metrics import capacity_text, crossing, run_line, turn_table, window_metrics
from bench.lib.pools import engine_config, history_chunks, kv_bytes_per_chunk
from bench.lib.presets import MODES, Preset
from bench.lib.sweep import measure, next_index, next_start, over, start_index, walk
from bench.sim_steady import steady_folder

PARTS = ("mfu", "decode", "profile", "serve", "extra", "steady")


def _log(*a) -> None:
    print(*a, flush=True)


# ---------------------------------------------------------------- mfu


def part_mfu(s: Settings, budget: float) -> dict[str, Any]:
    args = argparse.Namespace(
        model=s.model,
        device=s.device,
        dtype=s.dtype,
        prompts=s.prompts,
        requests=s.mfu_requests,
        repeats=s.mfu_repeats,
        batch_tokens=s.max_batch_tokens,
        sizes=s.matmul_sizes,
        threads=None,
    )
    r = mfu.run(args)
    return {
        "matmul_flops_per_s": r["matmul_flops_per_s"]["best"],
        "prefill": r["prefill"],
        "goal_mfu": r["goal_mfu"],
    }


# ---------------------------------------------------------------- decode


def hbm_bandwidth(device, mib: int) -> dict[str, float]:
    """Bytes per second of a large device-to-device copy (each byte read once, written once)."""
    import torch

    from engine.cache.profile import timed

    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    t = timed(lambda a=src, b=dst: b.copy_(a), torch.device(device), repeats=10)
    del src, dst
    return {"bytes": 2 * (mib << 20), "seconds": t, "bytes_per_s": 2 * (mib << 20) / t}


def _step_time(engine, steps: int) -> list[float]:
    import torch

    times = []
    for _ in range(steps):
        if engine.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            engine.step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
    return times


def decode_point(engine, batch: int, context: int, steps: int, tag: str) -> dict[str, Any]:
    """Median step time of `batch` turns decoding at `context` tokens (after a warm-up)."""
    import torch

    from engine import SamplingParams, Turn

    vocab = engine.args.vocab_size
    gen = torch.Generator().manual_seed(batch * 7919 + context)
    warm = 3
    # First turns only fill the contexts (one token each); the second turns, one token each,
    # then start together and decode in lockstep. One turn per conversation would not: its
    # early turns decode through the later ones' prefill steps (128 of them at 256 x 1k) and
    # end before the timed steps, which then run a fraction of the batch.
    ids = [f"{tag}-{i}" for i in range(batch)]
    fill = SamplingParams(max_tokens=1, ignore_eos=True)
    for cid in ids:
        engine.submit(Turn(cid, torch.randint(0, vocab, (context,), generator=gen).tolist(), fill))
    while engine.has_work():
        engine.step()
    sampling = SamplingParams(max_tokens=warm + steps + 4, ignore_eos=True)
    reqs = [
        engine.submit(Turn(cid, torch.randint(0, vocab, (1,), generator=gen).tolist(), sampling))
        for cid in ids
    ]
    while not all(r.output for r in reqs):
        engine.step()
    _step_time(engine, warm)
    made = engine.snapshot().counters.generated_tokens
    times = _step_time(engine, steps)
    # Tokens each timed step decoded: `batch` unless the engine ran fewer rows than asked (a
    # step time under its roofline means exactly that).
    rows = (engine.snapshot().counters.generated_tokens - made) / steps
    for r in reqs:
        engine.cancel(r)
    while engine.has_work():
        engine.step()
    for cid in ids:
        engine.free(cid)
    return {
        "seconds": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "rows_per_step": rows,
    }


def _decode_engine(s: Settings, model: str, batches: list[int]):
    from engine import Engine, EngineConfig

    return Engine(
        EngineConfig(
            model=model,
            device=s.device,
            dtype=s.dtype,
            cache_mode="gpu",
            gpu_cache_chunks=None if not s.dry else 64,
            cpu_cache_chunks=0,
            max_batch_tokens=s.max_batch_tokens,
            max_running=max(batches),
        )
    )


def decode_rows(engine, s, contexts, batches, bw, budget, moe: bool) -> list[dict[str, Any]]:
    """The decode points of one engine, each against its roofline: the weights a step reads
    (of a MoE model, those of the experts its batch touches) and the batch's KV, once at the
    measured bandwidth."""
    from engine.kv_pool import KVPool

    chunk = engine.config.chunk_size
    kv_token = KVPool.bytes_per_block(engine.args, chunk, engine.dtype) / chunk
    blocks = engine.pool.gpu.shape[2]
    usable = int(blocks * (1 - engine.config.admit_reserve)) - 1
    rows = []
    for context in contexts:
        for batch in batches:
            need = batch * -(-(context + s.decode_steps + 8) // chunk)
            row: dict[str, Any] = {"batch": batch, "context": context, "kv_blocks": need}
            if moe:
                row["experts_touched"] = experts_touched(engine.args, batch)
            if need > usable:
                row["skipped"] = f"KV needs {need} blocks, the pool has {usable}"
            elif time.monotonic() > budget:
                row["skipped"] = "part budget spent"
            else:
                tag = f"{'m' if moe else 'd'}{batch}"
                row.update(decode_point(engine, batch, context, s.decode_steps, tag))
                kv = batch * (context + s.decode_steps // 2) * kv_token
                wbytes = weight_bytes(engine.args, engine.dtype.itemsize, batch)
                roof = (wbytes + kv) / bw["bytes_per_s"]
                row.update(
                    roofline_s=roof,
                    ratio=row["seconds"] / roof,
                    tokens_per_s=batch / row["seconds"],
                    kv_bytes=kv,
                )
                if moe:
                    row["weight_bytes"] = wbytes
            rows.append(row)
            _log(("moe " if moe else "") + _decode_line(row))
    return rows


def part_decode(s: Settings, budget: float) -> dict[str, Any]:
    from engine.kv_pool import KVPool

    engine = _decode_engine(s, s.model, s.batches)
    try:
        chunk = engine.config.chunk_size
        kv_token = KVPool.bytes_per_block(engine.args, chunk, engine.dtype) / chunk
        blocks = engine.pool.gpu.shape[2]
        bw = hbm_bandwidth(engine.device, s.copy_mib)
        wbytes = weight_bytes(engine.args, engine.dtype.itemsize)
        _log(f"HBM copy {bw['bytes_per_s'] / 1e9:.0f} GB/s; weights {wbytes / 1e9:.2f} GB")
        rows = decode_rows(engine, s, s.contexts, s.batches, bw, budget, moe=False)
    finally:
        engine.close()
    del engine
    out = {
        "hbm": bw,
        "weight_bytes": wbytes,
        "kv_bytes_per_token": kv_token,
        "pool_blocks": blocks,
        "points": rows,
        "goal_ratio_at_64": 1.3,
    }
    if s.moe_model:
        out["moe"] = decode_moe(s, bw, budget)
    return out


def decode_moe(s: Settings, bw: dict[str, float], budget: float) -> dict[str, Any]:
    """The MoE shape's points, on an engine of its own (the dense one freed first)."""
    import gc

    import torch

    from engine.kv_pool import KVPool
    from engine.model.loader import model_args
    from engine.model.moe import pick

    a = model_args(s.moe_model)
    out: dict[str, Any] = {"model": s.moe_model, "all_weight_bytes": None, "points": []}
    if time.monotonic() > budget - 20:  # no time left to build its engine and time a step
        out["skipped"] = "part budget spent"
        return out
    gc.collect()
    if s.device == "cuda":
        torch.cuda.empty_cache()
    engine = _decode_engine(s, s.moe_model, s.moe_batches)
    try:
        chunk = engine.config.chunk_size
        out["all_weight_bytes"] = weight_bytes(a, engine.dtype.itemsize, 1 << 20)  # every expert
        out["kv_bytes_per_token"] = KVPool.bytes_per_block(a, chunk, engine.dtype) / chunk
        out["experts_path"] = pick(engine.device.type, engine.dtype)  # grouped or loop
        ctx = [s.moe_context]
        out["points"] = decode_rows(engine, s, ctx, s.moe_batches, bw, budget, moe=True)
    finally:
        engine.close()
    return out


def _decode_line(r: dict[str, Any]) -> str:
    head = f"decode batch {r['batch']:>4} context {r['context']:>5}: "
    if "skipped" in r:
        return head + "skipped (" + r["skipped"] + ")"
    line = head + (
        f"{r['seconds'] * 1e3:8.2f} ms/step, roofline {r['roofline_s'] * 1e3:7.2f} ms, "
        f"x{r['ratio']:.2f}"
    )
    rows = r.get("rows_per_step")  # absent in reports made before it was counted
    if rows is not None and rows < r["batch"]:
        line += f" (ONLY {rows:.1f} rows a step: not the batch asked for)"
    return line


# ---------------------------------------------------------------- profile


def part_profile(s: Settings, budget: float) -> dict[str, Any]:
    """Where a step's time goes, per mode at one load (`bench/lib/step_profile.py`): waves of
    one turn per conversation, the first untimed, over a GPU tier about half their context
    (pensieve swaps, gpu-only recomputes what it dropped, stateless recomputes everything);
    then the copy rates of scattered chunks per direction and way (`bench.swap`)."""
    import gc

    import torch

    from bench.lib.step_profile import measure_steps, summarize
    from bench.swap import scattered_rates
    from engine import Engine, EngineConfig, SamplingParams, Turn
    from engine.model.loader import model_args

    device = torch.device(s.device)
    dtype = getattr(torch, s.dtype)
    rates = scattered_rates(
        model_args(s.model), 32, device, dtype, s.profile_rate_chunks, repeats=3
    )
    for key, r in rates.items():
        _log(f"scattered {key:<10} {r['GBps']:7.2f} GB/s, host {r['host_s'] * 1e3:.2f} ms")
    modes: dict[str, Any] = {}
    skipped: list[str] = []
    last_s = 0.0
    for mode in SERVE_MODES:
        if time.monotonic() + last_s > budget:
            skipped.append(f"{mode}: part budget spent")
            continue
        t0 = time.monotonic()
        engine = Engine(
            EngineConfig(
                model=s.model,
                device=s.device,
                dtype=s.dtype,
                cache_mode=mode,
                gpu_cache_chunks=s.profile_gpu_chunks,
                cpu_cache_chunks=s.profile_cpu_chunks if mode == "pensieve" else 0,
                max_batch_tokens=s.max_batch_tokens,
                max_running=s.profile_conversations,
            )
        )
        try:
            modes[mode] = _profile_mode(engine, s, measure_steps, summarize, Turn, SamplingParams)
        finally:
            engine.close()
            del engine
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        last_s = time.monotonic() - t0
        modes[mode]["elapsed_s"] = last_s
        _log(_profile_line(mode, modes[mode]))
    return {"modes": modes, "scattered_rates": rates, "skipped": skipped}


def _profile_mode(engine, s: Settings, measure_steps, summarize, Turn, SamplingParams) -> dict:
    import torch

    gen = torch.Generator().manual_seed(11)
    vocab = engine.args.vocab_size
    sp = SamplingParams(max_tokens=s.profile_output, ignore_eos=True)
    profiles = []
    for t in range(s.profile_turns):
        n = s.profile_prompt if t == 0 else s.profile_followup
        for c in range(s.profile_conversations):
            ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
            engine.submit(Turn(f"p{c}", ids, sp))
        if t == 0:  # fills the caches, warms the kernels: not timed
            while engine.has_work():
                engine.step()
            continue
        p = measure_steps(engine, steps=1_000_000, profiled_steps=s.profile_launch_steps)
        if p is not None:
            profiles.append(p)
        while engine.has_work():
            engine.step()
    row = summarize(profiles) if profiles else {"steps": 0}
    c = engine.snapshot().counters
    keys = ("swapped_in_tokens", "swapped_out_tokens", "recomputed_tokens", "dropped_tokens",
            "ahead_chunks", "ahead_reclaimed_chunks", "ahead_read_chunks", "ahead_wasted_chunks")  # fmt: skip
    row["counters"] = {k: getattr(c, k) for k in keys}
    return row


def _profile_line(mode: str, r: dict[str, Any]) -> str:
    def f(key: str, fmt: str) -> str:
        v = r.get(key)
        return "-" if v is None else fmt % v

    return (
        f"profile {mode:<10} host {f('host_ms_per_step', '%.2f')} of "
        f"{f('wall_ms_per_step', '%.2f')} ms/step, device busy "
        f"{f('device_busy_share', '%.2f')}, copies {f('copy_ms_per_step', '%.2f')} ms/step "
        f"({f('copy_overlap_share', '%.2f')} overlapped), launches/step "
        f"{f('launches_per_step', '%.0f')}"
    )


# ---------------------------------------------------------------- serve


WARM_PROMPTS = (64, 512, 2048)  # tokens: the prompts `warm_up` sends together


async def warm_up(engine) -> None:
    """A few turns of a few prompt lengths, decoded together and forgotten before any window:
    a fresh engine's first steps build kernels and capture graphs, which a window must not
    time (at 4e07f94 each mode's first run, at 12/s, took more per step than its second at
    16/s with more rows: 28.7 vs 26.4 ms stateless, 24.8 vs 23.7 gpu, 25.5 vs 25.3 pensieve)."""
    from engine import SamplingParams, Turn

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
        deadline = time.monotonic() + window + drain
        driver = EngineDriver(engine, f"{name}-{k:g}-{rate:g}", temperature, deadline)
        plans = wl.plan(self.convs, rate, s.think_s / k, 0)
        records, wall, counters = await measure(engine, driver, plans, name, stop_s=window)
        run = {
            "mode": name,
            "engine_mode": mode,
            "rate": rate,
            "scale": k,
            "think_s": s.think_s,
            "think_replayed_s": s.think_s / k,
            "temperature": temperature,
            "gpu_cache_chunks": preset.gpu_cache_chunks,
            "cpu_cache_chunks": preset.cpu_cache_chunks,
            "max_waiting": engine.engine.config.max_waiting,  # its twin refuses as it did
            "window_s": window,
            "wall_s": wall,
            "metrics": window_metrics(records, wall),
            "counters": counters,
            "turns": turn_table(records),
        }
        _log(run_line(run) + f" cut {run['metrics']['cancelled_at_drain']} k={k:g}")
        return run

    async def _engine(self, mode: str, preset: Preset):
        """The engine of `mode` with these tiers; runs of other labels (a sampled run) reuse
        it: each run frees its own conversations."""
        from engine import AsyncEngine

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


async def sweep(r: Runner, mode: str, start: int, k: float, label: str = "", oracle=None):
    """One mode's runs along `walk` (or until the budget ends)."""
    runs: list[dict[str, Any]] = []
    steps = walk(len(r.s.rates), start)
    i = next(steps, None)
    while i is not None:
        run = await r.run(mode, r.s.rates[i], k, oracle, label)
        if run is None:
            break
        runs.append(run)
        i = next_index(steps, over(run, r.s.bound))
    return runs


async def part_serve(s: Settings, budget: float, previous: dict | None) -> dict[str, Any]:
    convs, info = load_sample(s)
    r = Runner(s, convs, budget)
    runs: list[dict[str, Any]] = []
    start = start_index(s.rates, s.start_rate)
    try:
        for mode in SERVE_MODES:
            got = await sweep(r, mode, start, s.scale)
            runs += got
            start = next_start(s.rates, got, s.bound, start)
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
        runs += await sweep(r, "pensieve", s.rates.index(rate) if rate in s.rates else 0,
                            s.scale, label="oracle", oracle=oracle)  # fmt: skip
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


# ---------------------------------------------------------------- steady


async def clear(engine) -> None:
    """Forget every conversation the engine holds (a run's, and those seeded for it)."""
    e = engine.engine
    ids = set(e.streams) | {t.id for t in e.cache.held()}
    await asyncio.gather(*(engine.free(cid) for cid in ids))


async def steady_run(engine, s: Settings, mode: str, state, path: Path, convs) -> dict[str, Any]:
    """One run from a steady state: the engine cleared and seeded with it, its continuation
    replayed (`steady_warmup_s` sent, not counted; then `steady_window_s` counted; then at
    most `steady_drain_s` before what still runs is cut, at its lower bound)."""
    tag = f"steady-{mode}-{state.rate:g}"
    t = time.monotonic()
    await clear(engine)
    seeds, bad = st.seeds(state, convs, tag, engine.engine.now(), engine.engine.cache.chunk_size)
    await engine.seed(seeds)
    seed_s = time.monotonic() - t
    stop = s.steady_warmup_s + s.steady_window_s
    plans = st.resume(state, convs, stop)
    deadline = time.monotonic() + stop + s.steady_drain_s
    driver = EngineDriver(engine, tag, 0.0, deadline)
    records, wall, counters = await measure(engine, driver, plans, tag, stop_s=stop)
    run = st.run_row(s, mode, state, path, (len(seeds), bad), seed_s, wall, records, convs)
    run["counters"] = counters
    _log(run_line(run) + f" cut {run['metrics']['cancelled_at_drain']} seeded {len(seeds)} "
         f"in {seed_s:.1f} s")  # fmt: skip
    return run


async def part_steady(s: Settings, budget: float, previous: dict | None) -> dict[str, Any]:
    """The paper's setting unscaled on one GPU, in its steady state: per mode one engine;
    per rate of `steady_rates` (a pair that brackets the bound, chosen beforehand by the
    simulator) the engine cleared, seeded with the state the simulator wrote at the end of
    its warm-up at that rate, and its continuation replayed (`steady_run`). A mode whose
    tiers do not fit this machine (the oracle) or whose states are missing is skipped and
    listed."""
    from engine import AsyncEngine

    convs, info = load_sample(s)
    folder = steady_folder(s, convs)
    runs: list[dict[str, Any]] = []
    skipped: list[str] = []
    starts: dict[str, float] = {}
    for mode in STEADY_MODES:
        if mode in s.steady_skipped and not s.steady_rates.get(mode):
            skipped.append(f"{mode}: {s.steady_skipped[mode]}")
            continue
        states, missing = steady_states(s, folder, mode)
        if missing:
            skipped.append(f"{mode}: no state {', '.join(missing)}")
            _log(f"skip {mode}: no state {missing}")
        if not states:
            continue
        preset = steady_preset(s, mode, convs, max(r for r, _, _ in states))
        cpu = preset.cpu_cache_chunks if MODES[mode].cache_mode == "pensieve" else 0
        why = no_room(s, preset.gpu_cache_chunks, cpu) or state_mismatch(states[0][2], preset)
        if why:
            skipped.append(f"{mode}: {why}")
            _log(f"skip {mode}: {why}")
            continue
        run_s = s.steady_warmup_s + s.steady_window_s + s.steady_drain_s
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
                    runs.append(await steady_run(engine, s, mode, state, path, convs))
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


# ---------------------------------------------------------------- the report


def summary(report: dict[str, Any]) -> str:
    """The table printed at the end (and kept in the JSON)."""
    lines = [
        f"GPU report: {report['environment']['device']} at {report['environment']['git_commit']}"
    ]
    mfu = report.get("mfu")
    if mfu:
        for r in mfu["prefill"]:
            lines.append(
                f"  prefill {r['prompt_tokens']:>6} tokens   MFU {r['mfu']:.2f}   (goal 0.5)"
            )
    dec = report.get("decode")
    if dec:
        lines.append(f"  HBM copy {dec['hbm']['bytes_per_s'] / 1e9:.0f} GB/s")
        lines += ["  " + _decode_line(r) for r in dec["points"]]
        lines += ["  moe " + _decode_line(r) for r in dec.get("moe", {}).get("points", [])]
    prof = report.get("profile")
    if prof:
        lines += ["  " + _profile_line(m, r) for m, r in prof["modes"].items()]
        for key, r in prof["scattered_rates"].items():
            lines.append(f"  profile scattered {key:<10} {r['GBps']:.2f} GB/s")
        lines += [f"  profile skipped: {x}" for x in prof["skipped"]]
    for part in ("serve", "extra", "steady"):
        res = report.get(part)
        if not res:
            continue
        for m, c in res["capacity"].items():
            p90 = res["capacity_p90"][m]
            bound = report["settings"]["bound"] * 1e3
            lines.append(
                f"  {part} {m:<18} capacity {capacity_text(c)} at {bound:g} ms/token mean, "
                f"p90 {capacity_text(p90)}"
                + (
                    f" (refusing runs left out at {c['unmeasured_rates']}/s)"
                    if c.get("unmeasured_rates")
                    else ""
                )
            )
        for line in res.get("skipped", []):
            lines.append(f"  {part} skipped: {line}")
    c = report.get("claims", {})
    for key, val in c.items():
        lines.append(f"  {key}: {_fmt(val) if isinstance(val, float) else val}")
    return "\n".join(lines)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def claims(report: dict[str, Any]) -> dict[str, Any]:
    cap = report.get("serve", {}).get("capacity", {})
    extra = report.get("extra", {})
    val = lambda c: c["capacity_rps"] if c and c["crossed"] else None  # noqa: E731
    p, st, g = (val(cap.get(m)) for m in ("pensieve", "stateless", "gpu"))
    o = val(extra.get("capacity", {}).get("oracle"))
    steady = report.get("steady", {}).get("capacity", {})
    sst, sg, sp, so = (val(steady.get(m)) for m in STEADY_MODES)
    return {
        "pensieve_over_stateless": p / st if p and st else None,
        "pensieve_over_gpu": p / g if p and g else None,
        "pensieve_over_oracle": p / o if p and o else None,
        "lru_recomputes_more_by": (extra.get("eviction") or {}).get("fewer_recomputed"),
        "sampled_over_greedy_tps": (
            (extra.get("sampled_vs_greedy") or {}).get("throughput_tps", {}).get("ratio")
        ),
        # The steady part (the paper's setting, unscaled): capacities where both crossed
        "steady_pensieve_over_stateless": sp / sst if sp and sst else None,
        "steady_pensieve_over_gpu": sp / sg if sp and sg else None,
        "steady_pensieve_over_oracle": sp / so if sp and so else None,
    }


def plot(report: dict[str, Any], path: Path) -> list[Path]:
    """Decode step vs roofline per point, and the serving curves of both serving parts."""
    from bench.lib.plots import plot_bars, plot_serve

    out = []
    dec = report.get("decode")
    if dec and any("seconds" in r for r in dec["points"]):
        rows = []
        for r in dec["points"]:
            if "seconds" in r:
                rows.append({"name": f"b{r['batch']} c{r['context']}", "x": r["ratio"]})
        for r in dec.get("moe", {}).get("points", []):
            if "seconds" in r:
                rows.append({"name": f"moe b{r['batch']} c{r['context']}", "x": r["ratio"]})
        title = f"decode step / roofline ({report['environment']['device']})"
        out.append(
            plot_bars(
                rows,
                "x",
                "step time / roofline",
                title,
                path.with_name(path.stem + "-decode.png"),
                "%.2f",
            )
        )
    runs = report.get("serve", {}).get("runs", []) + [
        x for x in report.get("extra", {}).get("runs", []) if x["mode"] != "pensieve"
    ]
    if runs:
        # One think time column: the scaled replay (the unscaled run is drawn with it).
        flat = [{**x, "think_s": report["settings"]["think_s"]} for x in runs]
        res = {
            "runs": flat,
            "preset": {"latency_bound": report["settings"]["bound"], "model": report["settings"]["model"],
                       "conversations": report["settings"]["conversations"],
                       "note": f"think time / {report['settings']['scale']:g}, tiers / {report['settings']['scale']:g}"},
            "environment": report["environment"],
        }  # fmt: skip
        out.append(plot_serve(res, path.with_name(path.stem + "-serve.png")))
    steady = report.get("steady", {}).get("runs", [])
    if steady:
        s = report["settings"]
        res = {
            "runs": steady,
            "preset": {"latency_bound": s["bound"], "model": s["model"],
                       "note": f"steady state, think time {s['steady_think_s']:g} s, tiers "
                               f"{s['steady_gpu_gb']:g} + {s['steady_cpu_gb']:g} GiB, unscaled"},
            "environment": report["environment"],
        }  # fmt: skip
        out.append(plot_serve(res, path.with_name(path.stem + "-steady.png")))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.gpu_report", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--part", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", help="default: dummy:llama-2-13b-gqa10 (dummy:tiny on the CPU)")
    ap.add_argument("--budget", type=float, help="seconds per part")
    ap.add_argument("--rates", help="comma-separated ladder of new conversations per second")
    ap.add_argument("--start-rate", type=float, help="where the first mode's sweep starts")
    ap.add_argument("--scale", type=float, help="k: think time / k and tiers / k")
    ap.add_argument("--window", type=float, help="seconds each serving run sends turns")
    ap.add_argument("--out", type=Path, help="default bench/results/gpu-report-<device>.json")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    parts = [p for p in args.part.split(",") if p]
    if bad := [p for p in parts if p not in PARTS]:
        ap.error(f"unknown parts {bad}; choose from {PARTS}")
    if args.device == "cpu":
        s = dry_settings(args.model or "dummy:tiny")
    else:
        s = Settings(device=args.device, model=args.model or Settings.model)
    for key, val in (("budget_s", args.budget), ("start_rate", args.start_rate),
                     ("scale", args.scale), ("window_s", args.window)):  # fmt: skip
        if val is not None:
            s = replace(s, **{key: val})
    if args.rates:
        s = replace(s, rates=[float(x) for x in args.rates.split(",")])

    import torch

    if s.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: use --device cpu for the dry run")
    env = environment(s.device)
    out = args.out or RESULTS / f"gpu-report-{device_slug(env['device'])}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    if report.get("settings", {}).get("model") not in (None, s.model):
        ap.error(f"{out} holds a report of another model; pass --out")
    for part in parts:
        t0 = time.monotonic()
        # The steady part's own budget (engine starts included) unless --budget says
        part_budget = s.steady_budget_s if part == "steady" and args.budget is None else s.budget_s
        if part == "profile":  # short whatever the others get
            part_budget = min(part_budget, s.profile_budget_s)
        budget = t0 + part_budget
        _log(f"== {part} (budget {part_budget:.0f} s)")
        if part == "mfu":
            res = part_mfu(s, budget)
        elif part == "decode":
            res = part_decode(s, budget)
        elif part == "profile":
            res = part_profile(s, budget)
        elif part == "serve":
            res = asyncio.run(part_serve(s, budget, report))
        elif part == "extra":
            res = asyncio.run(part_extra(s, budget, report))
        else:
            res = asyncio.run(part_steady(s, budget, report))
        res["elapsed_s"] = time.monotonic() - t0
        res["git_commit"] = env["git_commit"]
        report[part] = res
        report.setdefault("parts_environment", {})[part] = env
        report.update(benchmark="gpu_report", environment=env, settings=asdict(s))
        report["claims"] = claims(report)
        out.write_text(json.dumps(report, indent=1, default=float) + "\n")  # each part kept at once
    report["table"] = summary(report)
    out.write_text(json.dumps(report, indent=1, default=float) + "\n")
    print(report["table"])
    print(f"wrote {out}")
    if not args.no_plot:
        try:
            for p in plot(report, out.with_suffix(".png")):
                print(f"wrote {p}")
        except ImportError as e:  # a bare GPU machine: plot later where matplotlib is
            print(f"no plot ({e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
