"""Multi-turn serving benchmark: replay ShareGPT conversations and measure latency vs throughput.

    python -m bench.serve --preset cpu                 # the engine in process, every mode
    python -m bench.serve --preset gpu --think 600     # one of the paper's settings
    python -m bench.serve --preset gpu --dry-run       # its plumbing on the CPU in seconds
    python -m bench.serve --url http://127.0.0.1:8000 --token=T --preset cpu --modes server
    python -m bench.serve --url http://127.0.0.1:8000 --token=T --preset cpu --api openai
    python -m bench.serve --typing 2,10               # typing-aware prefetch, ~14 minutes
    python -m bench.serve --typing 1,2 --typing-think 3,5 --conversations 4 --order off,on

In process, each mode (pensieve / gpu / stateless, lru, separate prefill and decode) gets
its own AsyncEngine; every conversation is an asyncio task that arrives, sends a turn,
waits for the whole reply, thinks, and sends the next. With --url the same replay goes to
a running server over its WebSocket protocol (conversations created through REST), or with
--api openai through its OpenAI API (each turn resends the whole chat).

With --typing the replay is typing-aware prefetch's (`bench/lib/typing_hints.py`): the
preset's conversations (8) arrive at its first rate (0.05/s) on tight tiers, users think
12-20 s (--typing-think) before a later turn and start typing LO-HI s before sending; the
same schedule runs on fresh pensieve engines in --order (off, on, on, off: drift cancels),
hints told to the engine in the runs that are on. TTFT of returning and first turns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from bench.lib import typing_hints as th
from bench.lib import workload as wl
from bench.lib.common import RESULTS, ROOT, environment
from bench.lib.metrics import claims, merge_runs, metrics
from bench.lib.pools import (
    engine_config,
    fit_pools,
    history_chunks,
    kv_bytes_per_chunk,
    model_args,
    size_pools,
)
from bench.lib.presets import MODES, PRESETS, Preset, dry_run, floats, with_changes
from bench.lib.replay import Real, at_url, in_process
from bench.lib.samples import load_workload, save_sample
from bench.lib.sweep import ladder
from engine import AsyncEngine


def _log(*a) -> None:
    print(*a, flush=True)


async def bench_engine(
    preset: Preset, modes: list[str], log=_log, sample_file=None, on_run=None
) -> dict[str, Any]:
    """Each mode's sweep on an AsyncEngine in this process (`replay.in_process`)."""
    preset = size_pools(preset)
    convs, workload = load_workload(preset, model_args(preset.model).max_context, sample_file)
    log(wl.format_summary(workload["summary"]))
    if preset.gpu_fraction is not None:
        preset = fit_pools(preset, convs)
    per = kv_bytes_per_chunk(preset.model, preset.dtype or "bfloat16", preset.kv_dtype)
    workload["pools"] = {
        "kv_dtype": preset.kv_dtype,
        "gpu_cache_chunks": preset.gpu_cache_chunks,
        "cpu_cache_chunks": preset.cpu_cache_chunks,
        "history_chunks": history_chunks(convs),
        "bytes_per_chunk": per,
        "gpu_cache_bytes": (preset.gpu_cache_chunks or 0) * per,
    }
    log(f"pools: {workload['pools']}")
    runs: list[dict[str, Any]] = []

    def done(run: dict[str, Any]) -> None:
        runs.append(run)
        if on_run is not None:
            on_run({"workload": workload, "runs": runs})

    await ladder(in_process(preset, convs, log, done), modes, preset, log=log)
    return {"workload": workload, "runs": runs}


async def bench_url(
    preset: Preset, url: str, token: str, log=_log, sample_file=None, api: str = "ws"
) -> dict[str, Any]:
    """The sweep against a running server (`replay.at_url`)."""
    convs, workload = load_workload(preset, preset.context_cap, sample_file)
    log(wl.format_summary(workload["summary"]))
    mode = "server-openai" if api == "openai" else "server"
    runs = await ladder(at_url(preset, convs, url, token, api, log), [mode], preset, log=log)
    return {"workload": workload, "runs": runs}


async def bench_typing(preset: Preset, think: tuple[float, float], lead: tuple[float, float],
                       order: list[bool], log=_log, sample_file=None) -> dict[str, Any]:  # fmt: skip
    """Typing-aware prefetch: the same schedule (`typing_hints.plans`) on a fresh pensieve
    engine per run, typing hints told in the runs of `order` that are on."""
    convs, workload = load_workload(preset, model_args(preset.model).max_context, sample_file)
    log(wl.format_summary(workload["summary"]))
    preset = fit_pools(replace(preset, gpu_fraction=th.GPU_FRACTION), convs)
    total = history_chunks(convs)
    preset = replace(preset, cpu_cache_chunks=max(1, int(total * th.CPU_FRACTION)))
    workload["pools"] = {"gpu_cache_chunks": preset.gpu_cache_chunks,
                         "cpu_cache_chunks": preset.cpu_cache_chunks, "history_chunks": total}  # fmt: skip
    log(f"pools: {workload['pools']}")
    plans = th.plans(convs, preset.rates[0], think, lead, preset.seed)
    runs = []
    for typing in order:
        engine = AsyncEngine(engine_config(preset, MODES["pensieve"]))
        await engine.start()
        try:
            tag = "typing" if typing else "plain"
            records, wall, counters = await Real(engine).run(plans, tag, typing=typing)
        finally:
            await engine.stop()
        run = {"typing": typing, "wall_s": wall, "metrics": metrics(records, wall),
               "returning": th.returning(records), "first": th.first(records),
               "counters": counters, "turns": th.turns(records)}  # fmt: skip
        runs.append(run)
        log(th.line(run))
    settings = {"name": preset.name, "model": preset.model, "conversations": len(convs),
                "rate": preset.rates[0], "think_s": list(think), "typing_lead_s": list(lead),
                "gpu_fraction": th.GPU_FRACTION, "cpu_fraction": th.CPU_FRACTION,
                "max_batch_tokens": preset.max_batch_tokens, "threads": preset.threads}  # fmt: skip
    return {"benchmark": "prefetch", "preset": settings, "workload": workload, "runs": runs,
            "summary": th.summarize(runs)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    ap.add_argument("--modes", help=f"comma-separated, of {sorted(MODES)}")
    ap.add_argument("--rates", help="comma-separated new conversations per second")
    ap.add_argument("--think", help="comma-separated mean think times (s)")
    ap.add_argument("--conversations", type=int)
    ap.add_argument("--time-scale", type=float)
    ap.add_argument("--model")
    ap.add_argument("--device")
    ap.add_argument("--dtype", help="model dtype (float32, bfloat16, float16)")
    ap.add_argument(
        "--compile-cpu", action="store_true", help="the CPU forward compiled by torch.compile"
    )
    ap.add_argument(
        "--kv-dtype",
        choices=("auto", "fp8", "int8"),
        help="KV cache dtype; 8-bit pools get the chunks that auto's bytes hold",
    )
    ap.add_argument("--gpu-chunks", type=int)
    ap.add_argument("--cpu-chunks", type=int)
    ap.add_argument("--threads", type=int, help="torch intra-op threads")
    ap.add_argument("--url", help="benchmark a running server instead of the engine in process")
    ap.add_argument(
        "--api",
        choices=("ws", "openai"),
        default="ws",
        help="with --url: drive the chat WebSocket or the OpenAI API (/v1)",
    )
    ap.add_argument(
        "--token",
        default=os.environ.get("PENSIEVE_TOKEN"),
        help="bearer token (write --token=T: a token may start with -)",
    )
    ap.add_argument(
        "--out", type=Path, help="JSON path (default bench/results/serve_<preset>.json)"
    )
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument(
        "--sample-file",
        type=Path,
        help="replay this tokenized sample (JSON) when it exists (default: the preset's)",
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="the preset's plumbing on the CPU in seconds (dummy:tiny, short turns); "
        "writes under the temp dir unless --out",
    )
    ap.add_argument("--save-sample", type=Path, help="write the tokenized sample as JSON and exit")
    ap.add_argument("--bound", type=float, help="mean normalized latency bound (s/token)")
    ap.add_argument(
        "--append",
        action="store_true",
        help="keep the runs already in --out (a sweep split over several invocations); "
        "a run of the same mode, think time and rate replaces the earlier one",
    )
    ap.add_argument(
        "--from-json", type=Path, help="recompute claims and the plot of an earlier result"
    )
    pair = lambda s: tuple(float(x) for x in s.split(","))  # noqa: E731
    ap.add_argument(
        "--typing",
        type=pair,
        metavar="LO,HI",
        help="typing-aware prefetch: users start typing LO-HI s before a turn; runs --order",
    )
    ap.add_argument(
        "--typing-think", type=pair, default=(12.0, 20.0), help="--typing: min,max think (s)"
    )
    ap.add_argument(
        "--order", default="off,on,on,off", help="--typing: runs without (off) and with hints"
    )
    args = ap.parse_args(argv)

    if args.from_json:
        result = json.loads(args.from_json.read_text())
        if args.bound is not None:
            result["preset"]["latency_bound"] = args.bound
        result["claims"] = claims(result["runs"], result["preset"]["latency_bound"])
        args.from_json.write_text(json.dumps(result, indent=1, default=float) + "\n")
        print(json.dumps(result["claims"], indent=1))
        if not args.no_plot:
            from bench.lib.plots import plot_serve

            print(f"wrote {plot_serve(result, args.from_json.with_suffix('.png'))}")
        return 0

    preset = PRESETS[args.preset]
    if args.dry_run:
        preset = dry_run(preset)
    if args.typing:  # prefetch's own defaults: 8 conversations arriving at 0.05/s
        preset = replace(preset, conversations=8, rates=[0.05])
    preset = with_changes(
        preset,
        rates=floats(args.rates) if args.rates else None,
        think_s=floats(args.think) if args.think else None,
        conversations=args.conversations,
        time_scale=args.time_scale,
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        compile_cpu=args.compile_cpu or None,
        gpu_cache_chunks=args.gpu_chunks,
        cpu_cache_chunks=args.cpu_chunks,
        threads=args.threads,
        latency_bound=args.bound,
    )
    # Tiers given in chunks replace the preset's sizes in GB.
    if args.gpu_chunks is not None:
        preset = replace(preset, gpu_cache_gb=None)
    if args.cpu_chunks is not None:
        preset = replace(preset, cpu_cache_gb=None)
    modes = args.modes.split(",") if args.modes else preset.modes
    unknown = [m for m in modes if m not in MODES]
    if unknown and not args.url:
        ap.error(f"unknown modes {unknown}; choose from {sorted(MODES)}")

    if args.save_sample:
        convs, workload = load_workload(preset, model_args(preset.model).max_context)
        save_sample(args.save_sample, convs, workload)
        print(wl.format_summary(workload["summary"]))
        print(f"wrote {args.save_sample}")
        return 0

    sample_file = args.sample_file or (preset.sample_file and ROOT / preset.sample_file)
    results = Path(tempfile.gettempdir()) / "pensieve-dry-run" if preset.dry else RESULTS
    kind = "prefetch" if args.typing else "serve"
    out = args.out or results / f"{kind}_{preset.name}{'_url' if args.url else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if preset.threads and not args.url:
        torch.set_num_threads(preset.threads)  # before `environment` records the count
    env = environment()  # the commit and machine the run started on
    if args.typing:
        order = [x.strip() == "on" for x in args.order.split(",")]
        result = asyncio.run(
            bench_typing(preset, args.typing_think, args.typing, order, sample_file=sample_file)
        )
        result["environment"] = env
        out.write_text(json.dumps(result, indent=1, default=float) + "\n")
        s = result["summary"]
        print(f"wrote {out}: returning TTFT {s.get('ttft_mean_change', float('nan')):+.1%}, "
              f"throughput {s.get('throughput_tps_change', float('nan')):+.1%}")  # fmt: skip
        if not args.no_plot and "typing" in s and "plain" in s:
            from bench.lib.plots import plot_prefetch

            print(f"wrote {plot_prefetch(result, out.with_suffix('.png'))}")
        return 0

    previous: list[dict[str, Any]] = []
    if args.append and out.exists():
        earlier = json.loads(out.read_text())
        if earlier.get("preset", {}).get("model") != preset.model:
            ap.error(f"--append: {out} holds runs of another model")
        previous = earlier["runs"]

    def report(result: dict[str, Any]) -> dict[str, Any]:
        for r in result["runs"]:
            r.setdefault("git_commit", env["git_commit"])
        runs = merge_runs(previous, result["runs"])
        result = {
            "benchmark": "serve",
            "preset": asdict(preset),
            "modes": list(dict.fromkeys(r["mode"] for r in runs)),
            "environment": env,
            "elapsed_s": time.monotonic() - t0,
            **result,
            "runs": runs,
            "claims": claims(runs, preset.latency_bound),
        }
        out.write_text(json.dumps(result, indent=1, default=float) + "\n")
        return result

    if args.url:
        if not args.token:
            ap.error("--url needs --token (or PENSIEVE_TOKEN)")
        result = asyncio.run(
            bench_url(preset, args.url, args.token, sample_file=sample_file, api=args.api)
        )
    else:
        result = asyncio.run(bench_engine(preset, modes, sample_file=sample_file, on_run=report))
    result = report(result)
    print(f"wrote {out} in {result['elapsed_s']:.0f}s")
    print(json.dumps(result["claims"], indent=1))
    if not args.no_plot:
        try:
            from bench.lib.plots import plot_serve
        except ImportError as e:  # a bare GPU machine: plot later where matplotlib is
            print(f"no plot ({e}); draw it with --from-json {out}")
            return 0
        print(f"wrote {plot_serve(result, out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
