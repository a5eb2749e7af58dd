"""The serving benchmark in virtual time: the real scheduler, cache and policy against a
device's cost model (`engine/sim`). Every figure it writes is SIMULATED.

    python -m bench.sim --preset paper-gqa --device a100-80gb          # the paper's setting
    python -m bench.sim --preset paper-opt --device h100 --think 600 --arrival 6000
    python -m bench.sim --scale 10000,50000,100000 --device h100       # host time per step
    python -m bench.sim --preset cpu --device cpu --compare real_1.json,real_2.json
                                        # against real `bench.serve --preset cpu` runs
    python -m bench.sim --device h100 --modes pensieve,pensieve-disk --cpu-gb 40 --disk-gb 1000
                                        # a disk tier behind a small CPU tier

The replay is `bench.serve`'s (the same sample, arrivals, think times and metrics), driven
by events in virtual time (`bench/lib/virtual.py`). After a mode's sweep crosses the latency
bound, the rates either side are bisected (geometric mean) to place its capacity better.
The paper presets measure a steady state: conversations (the sample repeated) arrive for
`--arrival` seconds at each rate and the turns sent after the first 30% are measured.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.lib import steady as st
from bench.lib import workload as wl
from bench.lib.common import ROOT, environment
from bench.lib.gpu_settings import (
    label,
)
from bench.lib.metrics import (
    claims,
    merge_runs,
    run_line,
    run_record,
    steady_metrics,
)
from bench.lib.pools import engine_config, fit_pools, for_mode, model_args, size_pools
from bench.lib.presets import MODES, PRESETS, Preset, floats, with_changes
from bench.lib.samples import load_workload
from bench.lib.sweep import ladder, over, plan, then
from bench.lib.virtual import HostTime, replay
from bench.sim_serve import SIM, gpu_main
from bench.window_memory import held
from engine import Engine
from engine.calibrate import fitted
from engine.sim.devices import DEVICES
from engine.types import KV_DTYPES

REFINE = 2  # bisections of the crossing per mode
SWEEP = ("rates", "max_rate", "modes")  # what --append may change between invocations


def _log(*a) -> None:
    print(*a, flush=True)


def sim_preset(preset: Preset, device: str) -> Preset:
    return replace(preset, device=f"sim:{device}")


def workload_of(preset: Preset, sample_file=None, log=_log):
    """The preset's conversations (capped at the model's positions) and tier sizes."""
    preset = size_pools(preset, host=False)
    max_context = model_args(preset.model).max_context
    convs, workload = load_workload(preset, max_context, sample_file)
    capped = [wl.cap_conversation(c, max_context - 1, preset.max_output) for c in convs]
    convs = [c for c in capped if c is not None]
    if preset.gpu_fraction is not None:
        preset = fit_pools(preset, convs)
    workload["summary"] = wl.summarize(convs)
    log(wl.format_summary(workload["summary"]))
    saving = window_saving(preset.model, convs)
    if saving is not None:
        workload["window_saving"] = saving
        log(f"sliding layers keeping only their window: {saving:.2f}x fewer KV bytes")
    workload["pools"] = {
        "gpu_cache_chunks": preset.gpu_cache_chunks,
        "cpu_cache_chunks": preset.cpu_cache_chunks,
        "disk_cache_gb": preset.disk_cache_gb,
    }
    return preset, convs, workload


def window_saving(model: str, convs: list[wl.Conversation]) -> float | None:
    """The byte saving the workload's contexts allow a model with sliding layers: every
    layer's KV over only what each layer can still read, summed over each turn's end (the
    contexts held over the conversations' lives); None without a window."""
    args = model_args(model)
    if not any(args.window(i) for i in range(args.n_layers)):
        return None
    every = only = 0
    for c in convs:
        for n in c.context_lens():
            h = held(model, args, n)
            every, only = every + h.all_layers_bytes, only + h.window_only_bytes
    return every / only if only else None


def repeat(convs: list[wl.Conversation], n: int) -> list[wl.Conversation]:
    """The sample cycled to n conversations (`steady.nth`: no copy shares another's KV)."""
    return [st.nth(convs, k) for k in range(n)]


def run_at(preset: Preset, mode_name: str, convs, rate: float, think: float) -> dict[str, Any]:
    """One run in virtual time, on an engine of its own. With `preset.arrival_s`, the sample
    repeated arrives for that long and the steady state after the warm-up is measured."""
    mode = MODES[mode_name]
    stop = None
    if preset.arrival_s is not None:
        convs = repeat(convs, max(len(convs), math.ceil(rate * preset.arrival_s)))
    plans = plan(convs, rate, think, preset.time_scale, preset.seed)
    if preset.arrival_s is not None:
        stop = max(p.arrival_s for p in plans) * preset.time_scale
    engine = Engine(engine_config(for_mode(preset, mode, convs), mode))
    host = HostTime()
    t = time.perf_counter()
    try:
        records, span = replay(engine, plans, mode_name, preset.time_scale, stop, host)
        counters = asdict(engine.snapshot().counters)
    finally:
        engine.close()
    extra = {"counters": counters, "host": host.summary(), "real_s": time.perf_counter() - t,
             "conversations": len(convs)}  # fmt: skip
    if engine.disk is not None:  # its writes, reads, dropped writes and evictions
        extra["disk"] = engine.disk.stats()
    run = run_record(mode_name, think, rate, records, span, extra)
    if stop is not None:
        run["metrics_whole"] = run["metrics"]
        run["metrics"] = steady_metrics(records, preset.warmup * stop, stop)
    return run


def run_mode(preset: Preset, mode_name: str, convs, log=_log, refine: int = REFINE) -> list[dict]:
    """One mode's sweep over rates at each think time, in virtual time; after the sweep
    crosses the bound, the rates either side are bisected (geometric mean) `refine` times."""
    runs: list[dict[str, Any]] = []
    for think in preset.think_s:

        def run(rate: float, think: float = think) -> dict[str, Any]:
            r = run_at(preset, mode_name, convs, rate, think)
            runs.append(r)
            log(run_line(r) + f"  [{r['conversations']} conversations, {r['real_s']:.0f}s real]")
            return r

        rates = ladder(preset, mode_name, log)
        rate = next(rates)
        while rate is not None:
            rate = then(rates, run(rate))
        for _ in range(refine):
            these = [r for r in runs if r["think_s"] == think]
            under = [r["rate"] for r in these if not over(r, preset.latency_bound)]
            past = [r["rate"] for r in these if over(r, preset.latency_bound)]
            if not under or not past or max(under) > min(past):
                break
            run(math.sqrt(max(under) * min(past)))
    return runs


def simulate(preset: Preset, device: str, modes: list[str], sample_file=None, log=_log,
             refine: int = REFINE) -> dict:  # fmt: skip
    preset = sim_preset(preset, device)
    preset, convs, workload = workload_of(preset, sample_file, log)
    runs = []
    for mode in modes:
        runs += run_mode(preset, mode, convs, log, refine)
    return {"preset": asdict(preset), "workload": workload, "runs": runs}


# ---- host time at scale ----------------------------------------------------------------------


def seed_idle(engine, convs: list[wl.Conversation], seed: int) -> None:
    """Idle conversations held by the engine's cache, as if each had run to its end at some
    time in the last hour: admitted and released in turn (the cache evicts, swaps out and
    drops as it would), their activity stamped in the past. They never return."""
    rng = random.Random(seed)
    cache, now = engine.cache, engine.now()
    for c in convs:
        tokens = min(c.context_lens()[-1], engine.max_context)
        cache.begin_step()
        t = cache.table(f"idle/{c.id}")
        cache.admit(t, 0, tokens)
        cache.release(t, tokens)
        engine.clock.touch(t.id, now - rng.uniform(0.0, 3600.0))


def scale(preset: Preset, device: str, counts: list[int], rate: float, window_s: float,
          sample_file=None, log=_log) -> dict:  # fmt: skip
    """Host time of the scheduler and cache per step against the simulated step: n idle
    conversations held in the tiers (`seed_idle`), and the sample arriving at `rate` for
    `window_s` virtual seconds (pensieve mode)."""
    preset = sim_preset(preset, device)
    preset, convs, workload = workload_of(preset, sample_file, log)
    out = []
    for n in counts:
        engine = Engine(engine_config(preset, MODES["pensieve"]))
        t = time.perf_counter()
        seed_idle(engine, repeat(convs, n), preset.seed)
        seeded_s = time.perf_counter() - t
        host = HostTime()
        t = time.perf_counter()
        plans = plan(convs, rate, preset.think_s[0], preset.time_scale, preset.seed)
        records, span = replay(engine, plans, "scale", preset.time_scale, window_s, host)
        cache = engine.cache
        (gpu, _, gpu_free), (cpu, _, cpu_free) = cache.usage("gpu"), cache.usage("cpu")
        row = {
            "conversations": n,
            "held": len(cache.held()),
            "gpu_blocks": [gpu - gpu_free, gpu],
            "cpu_blocks": [cpu - cpu_free, cpu],
            "rate": rate,
            "turns": len(records),
            "virtual_s": span,
            "seed_s": seeded_s,
            "real_s": time.perf_counter() - t,
            **host.summary(),
        }
        engine.close()
        out.append(row)
        log(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}))
    return {"preset": asdict(preset), "workload": workload, "scale": out}


# ---- simulated vs real -------------------------------------------------------------------------

KEYS = ("throughput_rps", "norm_latency_mean", "cached_tokens", "swapped_in_tokens",
        "recomputed_tokens")  # fmt: skip


def compare(reals: list[dict], sim: dict) -> dict:
    """Per mode and rate the real runs' mean (and their own spread) against the simulation:
    relative errors of throughput, mean normalized latency and the cache's token counts,
    and of each mode's capacity."""
    rows = []
    for s in sim["runs"]:
        same = [r for real in reals for r in real["runs"]
                if (r["mode"], r["rate"], r["think_s"]) == (s["mode"], s["rate"], s["think_s"])]  # fmt: skip
        if not same:
            continue
        row: dict[str, Any] = {"mode": s["mode"], "rate": s["rate"], "real_runs": len(same)}
        for key in KEYS:
            vals = [r["metrics"][key] for r in same]
            mean = sum(vals) / len(vals)
            row[key] = {
                "real": vals,
                "sim": s["metrics"][key],
                "error": (s["metrics"][key] - mean) / mean if mean else None,
                "real_spread": (max(vals) - min(vals)) / mean if mean else None,
            }
        row["saturated"] = any(over(r, sim["preset"]["latency_bound"]) for r in same)
        rows.append(row)
    bound = sim["preset"]["latency_bound"]
    sim_cap = claims(sim["runs"], bound)
    caps = {}
    for think, c in sim_cap.items():
        for mode, cap in c["capacity_rps"].items():
            real = [claims(r["runs"], bound).get(think, {}).get("capacity_rps", {}).get(mode)
                    for r in reals]  # fmt: skip
            real = [x for x in real if x]
            mean = sum(real) / len(real) if real else None
            caps[mode] = {
                "real": real,
                "sim": cap,
                "error": (cap - mean) / mean if cap and mean else None,
            }
    return {"points": rows, "capacity": caps, "speed": speed(reals, sim)}


def speed(reals: list[dict], sim: dict) -> dict:
    """The machine's speed probe during the real runs against the calibration's (a `cpu`
    model's): a ratio over 1 is a machine slower than when it was calibrated."""
    cal = sim.get("environment", {}).get("calibration", {}).get("probe_s")
    if not cal:
        return {}
    base = sum(cal) / len(cal)
    runs = [[r["mode"], r["rate"], [p / base for p in r["probe_s"]]]
            for real in reals for r in real["runs"] if r.get("probe_s")]  # fmt: skip
    ratios = [x for *_, ps in runs for x in ps]
    return {
        "calibration_probe_s": cal,
        "runs": runs,  # mode, rate, [before, after] over the calibration's
        "ratio_range": [min(ratios), max(ratios)] if ratios else None,
    }


def calibration(preset, mode: str) -> dict:
    """This machine's `cpu` calibration of the preset's model: which, its fit, its speed."""

    sim = replace(preset, device="sim:cpu")  # the config its engines had (their token budget)
    fit = fitted(engine_config(sim, MODES[mode]), Engine)
    keys = ("file", "created", "steps", "median_abs_error", "p90_abs_error", "probe_s")
    return {k: fit[k] for k in keys if k in fit}


def table(cmp: dict) -> str:
    """The error table as markdown (bench/README.md)."""
    lines = [
        "| mode | rate | throughput | mean norm. latency | cached | swapped in | recomputed |",
        "|---|---|---|---|---|---|---|",
    ]

    def cell(v: dict) -> str:
        if v["error"] is None:
            return "-"
        return f"{v['error'] * 100:+.0f}% (real spread {v['real_spread'] * 100:.0f}%)"

    for r in cmp["points"]:
        sat = " (past bound)" if r["saturated"] else ""
        lines.append(
            f"| {r['mode']} | {r['rate']:g}{sat} | " + " | ".join(cell(r[k]) for k in KEYS) + " |"
        )
    lines.append("")
    lines.append("| mode | capacity real (runs) | simulated | error |")
    lines.append("|---|---|---|---|")
    for mode, c in cmp["capacity"].items():
        real = ", ".join(f"{x:.3f}" for x in c["real"]) or "-"
        err = "-" if c["error"] is None else f"{c['error'] * 100:+.0f}%"
        sim = "-" if c["sim"] is None else f"{c['sim']:.3f}"
        lines.append(f"| {mode} | {real} | {sim} | {err} |")
    if cmp.get("speed", {}).get("ratio_range"):
        lo, hi = cmp["speed"]["ratio_range"]
        lines.append("")
        lines.append(f"The machine's speed probe in the real runs: x{lo:.2f} to x{hi:.2f} the time "
                     "it took at calibration (over 1: slower).")  # fmt: skip
    return "\n".join(lines)


# ---- command line ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sim", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="paper-gqa", choices=sorted(PRESETS))
    ap.add_argument("--device", default="a100-80gb", choices=DEVICES)
    ap.add_argument("--modes", help=f"comma-separated, of {sorted(MODES)}")
    ap.add_argument("--rates", help="comma-separated new conversations per second")
    ap.add_argument("--max-rate", type=float, help="double the rate up to this until crossed")
    ap.add_argument("--refine", type=int, default=REFINE, help="bisections of each crossing")
    ap.add_argument("--think", help="comma-separated mean think times (s)")
    ap.add_argument("--conversations", type=int)
    ap.add_argument("--model", help="the preset's model, e.g. dummy:gpt-oss-20b")
    ap.add_argument("--cpu-gb", type=float, help="the CPU tier in GiB (the preset's otherwise)")
    ap.add_argument("--disk-gb", type=float, help="the disk tier in GiB (pensieve-disk mode)")
    ap.add_argument(
        "--kv-dtype", choices=KV_DTYPES, help="8-bit KV: ~2x the chunks in the same GiB"
    )
    ap.add_argument("--bound", type=float, help="mean normalized latency bound (s/token)")
    ap.add_argument(
        "--arrival", type=float, help="seconds of arrivals per rate (steady-state presets)"
    )
    ap.add_argument("--threads", type=int, help="torch threads (the cpu device's calibration)")
    ap.add_argument("--sample-file", type=Path)
    ap.add_argument("--out", type=Path, help="JSON path (default bench/results/sim/...)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument(
        "--append",
        action="store_true",
        help="keep the runs already in --out (a sweep split over several invocations); "
        "a run of the same mode, think time and rate replaces the earlier one",
    )
    ap.add_argument("--scale", help="comma-separated conversation counts: host time per step")
    ap.add_argument("--window", type=float, default=600.0, help="--scale: virtual seconds")
    ap.add_argument("--scale-rate", type=float, default=1.0, help="--scale: new conversations/s")
    ap.add_argument("--compare", help="comma-separated real bench.serve results: error table")
    ap.add_argument(
        "--gpu-report",
        type=Path,
        help="simulate a GPU report's serve runs; writes <report>-sim-<device>.json beside it",
    )
    ap.add_argument(
        "--spread",
        type=int,
        default=0,
        help="--gpu-report: each run simulated this many times more, its sends moved by a "
        "few ms: the range of its mean latency, and the median's error",
    )
    ap.add_argument(
        "--gpu-serve",
        action="store_true",
        help="rehearse the GPU report's serve part (its default settings; --rates, "
        "--conversations, --bound change them): runs, wall time against its budget, crossings",
    )
    ap.add_argument(
        "--gpu-steady",
        action="store_true",
        help="rehearse the GPU report's steady part from its committed states "
        "(bench/sim_steady.py): runs, crossings, estimated time against its budget; with "
        "--gpu-report, simulate that report's steady runs (<report>-steady-sim-<device>.json)",
    )
    ap.add_argument(
        "--steady-states",
        action="store_true",
        help="the steady part's states: per mode (--modes) simulated warm-ups along a ladder "
        "of rates until a pair brackets the bound; writes their states (slow: minutes a run)",
    )
    args = ap.parse_args(argv)

    if args.gpu_serve or args.gpu_report or args.gpu_steady or args.steady_states:
        return gpu_main(args)

    preset = with_changes(
        PRESETS[args.preset],
        rates=args.rates and floats(args.rates),
        think_s=args.think and floats(args.think),
        conversations=args.conversations,
        latency_bound=args.bound,
        threads=args.threads,
        arrival_s=args.arrival,
        max_rate=args.max_rate,
        cpu_cache_gb=args.cpu_gb,
        disk_cache_gb=args.disk_gb,
        kv_dtype=args.kv_dtype,
        model=args.model,
    )
    if preset.threads:
        import torch

        torch.set_num_threads(preset.threads)
    modes = args.modes.split(",") if args.modes else preset.modes
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown modes {unknown}; choose from {sorted(MODES)}")
    sample_file = args.sample_file or (preset.sample_file and ROOT / preset.sample_file)
    kind = "scale" if args.scale else "serve"
    out = args.out or SIM / f"{kind}_{preset.name}_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    env = environment()
    env["device"] = label(args.device)
    env["simulated"] = True

    if args.scale:
        counts = [int(x) for x in args.scale.split(",")]
        result = scale(preset, args.device, counts, args.scale_rate, args.window, sample_file)
    else:
        # Against real runs: the rates they ran, no bisections in between.
        refine = 0 if args.compare else args.refine
        result = simulate(preset, args.device, modes, sample_file, refine=refine)
        for r in result["runs"]:
            r["git_commit"] = env["git_commit"]
        if args.append and out.exists():
            earlier = json.loads(out.read_text())
            same = lambda p: {k: v for k, v in p.items() if k not in SWEEP}  # noqa: E731
            if same(earlier["preset"]) != same(result["preset"]):
                ap.error(f"--append: {out} holds runs of other settings")
            for r in earlier["runs"]:
                r.setdefault("git_commit", earlier["environment"]["git_commit"])
            result["runs"] = merge_runs(earlier["runs"], result["runs"])
            t0 -= earlier["elapsed_s"]  # the sweep's time over every invocation
        result["claims"] = claims(result["runs"], preset.latency_bound)
    if args.device == "cpu":  # the calibration the runs stood on (made by their engines)
        env["calibration"] = calibration(preset, modes[0])
    result = {"benchmark": f"sim-{kind}", "simulated": label(args.device), "environment": env,
              "elapsed_s": time.monotonic() - t0, **result}  # fmt: skip
    if args.compare:
        reals = [json.loads(Path(p).read_text()) for p in args.compare.split(",")]
        result["compare"] = compare(reals, result)
        print(table(result["compare"]))
    out.write_text(json.dumps(result, indent=1, default=float) + "\n")
    print(f"wrote {out} in {result['elapsed_s']:.0f}s")
    if "claims" in result:
        print(json.dumps(result["claims"], indent=1))
    if not args.no_plot and not args.scale:
        from bench.lib.plots import plot_serve

        print(f"wrote {plot_serve(result, out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
