"""The GPU report's device parts (`bench.gpu_report`): prefill MFU (`bench.mfu`), decode
step time against its roofline (the weights and KV a step reads at the measured HBM
bandwidth; a mixture-of-experts shape too), and where a step's time goes per mode."""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import torch

from bench import mfu
from bench.lib.gpu_settings import SERVE_MODES, Settings, experts_touched, weight_bytes
from bench.lib.step_profile import measure_steps, summarize
from bench.swap import scattered_rates
from engine import Engine, EngineConfig, SamplingParams, Turn
from engine.cache.profile import timed
from engine.kv_pool import KVPool
from engine.model.loader import model_args
from engine.model.moe import pick


def _log(*a) -> None:
    print(*a, flush=True)


def part_mfu(s: Settings, budget: float, previous: dict | None = None) -> dict[str, Any]:
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


def hbm_bandwidth(device, mib: int) -> dict[str, float]:
    """Bytes per second of a large device-to-device copy (each byte read once, written once)."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    t = timed(lambda a=src, b=dst: b.copy_(a), torch.device(device), repeats=10)
    del src, dst
    return {"bytes": 2 * (mib << 20), "seconds": t, "bytes_per_s": 2 * (mib << 20) / t}


def _step_time(engine, steps: int) -> list[float]:
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
            _log(("moe " if moe else "") + decode_line(row))
    return rows


def part_decode(s: Settings, budget: float, previous: dict | None = None) -> dict[str, Any]:
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


def decode_line(r: dict[str, Any]) -> str:
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


def part_profile(s: Settings, budget: float, previous: dict | None = None) -> dict[str, Any]:
    """Where a step's time goes, per mode at one load (`bench/lib/step_profile.py`): waves of
    one turn per conversation, the first untimed, over a GPU tier about half their context
    (pensieve swaps, gpu-only recomputes what it dropped, stateless recomputes everything);
    then the copy rates of scattered chunks per direction and way (`bench.swap`)."""
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
            modes[mode] = _profile_mode(engine, s)
        finally:
            engine.close()
            del engine
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        last_s = time.monotonic() - t0
        modes[mode]["elapsed_s"] = last_s
        _log(profile_line(mode, modes[mode]))
    return {"modes": modes, "scattered_rates": rates, "skipped": skipped}


def _profile_mode(engine, s: Settings) -> dict:
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


def profile_line(mode: str, r: dict[str, Any]) -> str:
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
