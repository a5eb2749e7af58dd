"""The serving benchmark in virtual time: the real scheduler, cache and policy against a
device's cost model (`engine/sim`). Every figure it writes is SIMULATED.

    python -m bench.sim --preset paper-gqa --device a100-80gb          # the paper's setting
    python -m bench.sim --preset paper-opt --device h100 --think 600 --arrival 6000
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
import asyncio
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from bench.lib import workload as wl
from bench.lib.common import ROOT, environment
from bench.lib.gpu_settings import label
from bench.lib.metrics import claims, merge_runs
from bench.lib.pools import engine_config, fit_pools, model_args, size_pools
from bench.lib.presets import MODES, PRESETS, Preset, floats, with_changes
from bench.lib.replay import simulated
from bench.lib.samples import load_workload
from bench.lib.sweep import ladder
from bench.lib.versus import compare, table
from bench.sim_serve import SIM, gpu_main
from engine import Engine
from engine.calibrate import fitted
from engine.model.shapes import ModelArgs
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


def held_bytes(
    args: ModelArgs, tokens: int, chunk: int = 32, dtype_bytes: int = 2
) -> tuple[int, int]:
    """KV bytes of one conversation of `tokens` positions: every layer keeping every chunk,
    and sliding layers keeping only the chunks that overlap positions tokens - window + 1 ..
    tokens - 1 (the keys a later query can still read)."""
    per_chunk_layer = 2 * chunk * args.n_kv_heads * args.head_dim * dtype_bytes  # K and V
    chunks = -(-tokens // chunk)
    sliding = sum(args.window(i) is not None for i in range(args.n_layers))
    window = args.sliding_window or 0
    local = (tokens - 1) // chunk - max(0, tokens - window + 1) // chunk + 1
    every = args.n_layers * chunks * per_chunk_layer
    only = ((args.n_layers - sliding) * chunks + sliding * local) * per_chunk_layer
    return every, only


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
            e, o = held_bytes(args, n)
            every, only = every + e, only + o
    return every / only if only else None


def simulate(preset: Preset, device: str, modes: list[str], sample_file=None, log=_log,
             refine: int = REFINE) -> dict:  # fmt: skip
    """Each mode's sweep in virtual time (`replay.simulated`, an engine of its own per run);
    after a sweep crosses the bound, the rates either side bisected `refine` times."""
    preset = sim_preset(preset, device)
    preset, convs, workload = workload_of(preset, sample_file, log)
    runs = asyncio.run(ladder(simulated(preset, convs, log), modes, preset, refine, log))
    return {"preset": asdict(preset), "workload": workload, "runs": runs}


def calibration(preset, mode: str) -> dict:
    """This machine's `cpu` calibration of the preset's model: which, its fit, its speed."""
    sim = replace(preset, device="sim:cpu")  # the config its engines had (their token budget)
    fit = fitted(engine_config(sim, MODES[mode]), Engine)
    keys = ("file", "created", "steps", "median_abs_error", "p90_abs_error", "probe_s")
    return {k: fit[k] for k in keys if k in fit}


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
        torch.set_num_threads(preset.threads)
    modes = args.modes.split(",") if args.modes else preset.modes
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown modes {unknown}; choose from {sorted(MODES)}")
    sample_file = args.sample_file or (preset.sample_file and ROOT / preset.sample_file)
    out = args.out or SIM / f"serve_{preset.name}_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    env = environment()
    env["device"] = label(args.device)
    env["simulated"] = True

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
    result = {"benchmark": "sim-serve", "simulated": label(args.device), "environment": env,
              "elapsed_s": time.monotonic() - t0, **result}  # fmt: skip
    if args.compare:
        reals = [json.loads(Path(p).read_text()) for p in args.compare.split(",")]
        result["compare"] = compare(reals, result)
        print(table(result["compare"]))
    out.write_text(json.dumps(result, indent=1, default=float) + "\n")
    print(f"wrote {out} in {result['elapsed_s']:.0f}s")
    print(json.dumps(result["claims"], indent=1))
    if not args.no_plot:
        from bench.lib.plots import plot_serve

        print(f"wrote {plot_serve(result, out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
