"""Prefill model-flops utilisation: the engine's prefill rate against the device's matmul rate.

    python -m bench.mfu                                  # dummy:llama-2-13b-gqa10, bf16, CUDA
    python -m bench.mfu --model dummy:tiny --device cpu --dtype float32 --prompts 256,512

The stateless baseline is only strong if prefill runs near the matmul rate. Measured: the
device's dense matmul rate in the model's dtype (best of a few square sizes); the engine
prefilling `--requests` fresh `--prompts`-token conversations to one output token through
`Engine.step` (median of repeats); model flops per prompt (2 x the weights each token
multiplies, causal QK^T and PV, the LM head of sampled rows). MFU = flops / time / rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.lib.common import RESULTS, environment, write_json
from bench.lib.flops import linear_flops_per_token, prefill_flops  # noqa: F401 (read as mfu.*)
from bench.lib.pools import model_args
from engine import Engine, EngineConfig, SamplingParams, Turn
from engine.cache.profile import timed


def matmul_rate(device, dtype, sizes: list[int], repeats: int = 10) -> dict[str, Any]:
    """Dense n x n x n matmul rate (flop/s) per size; the best is the device's rate."""
    rates = {}
    for n in sizes:
        x = torch.randn(n, n, device=device, dtype=dtype)
        y = torch.randn(n, n, device=device, dtype=dtype)
        rates[n] = 2 * n**3 / timed(lambda x=x, y=y: x @ y, torch.device(device), repeats)
        del x, y
    return {"by_size": rates, "best": max(rates.values())}


def prefill_time(engine, prompt: int, requests: int, vocab: int, tag: str) -> float:
    """Wall seconds for the engine to prefill `requests` fresh prompts and sample one token."""
    gen = torch.Generator().manual_seed(prompt)
    ids = []
    for i in range(requests):
        tokens = torch.randint(0, vocab, (prompt,), generator=gen).tolist()
        cid = f"{tag}-{prompt}-{i}"
        engine.submit(Turn(cid, tokens, SamplingParams(max_tokens=1, ignore_eos=True)))
        ids.append(cid)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    t = time.perf_counter()
    while engine.has_work():
        engine.step()  # returns sampled tokens on the host: each step ends synchronised
    elapsed = time.perf_counter() - t
    for cid in ids:
        engine.free(cid)
    return elapsed


def run(args) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    a = model_args(args.model)
    longest = max(args.prompts)
    chunks = args.requests * (-(-longest // 32) + 1) + 8
    engine = Engine(
        EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            cache_mode="stateless",
            gpu_cache_chunks=chunks,
            cpu_cache_chunks=0,
            max_batch_tokens=args.batch_tokens,
        )
    )
    dtype = engine.dtype
    mm = matmul_rate(engine.device, dtype, args.sizes)
    rows = []
    try:
        prefill_time(engine, min(args.prompts), 1, a.vocab_size, "warm")
        for prompt in args.prompts:
            times = [
                prefill_time(engine, prompt, args.requests, a.vocab_size, f"r{k}")
                for k in range(args.repeats)
            ]
            t = statistics.median(times)
            flops = args.requests * prefill_flops(a, prompt)
            rows.append(
                {
                    "prompt_tokens": prompt,
                    "requests": args.requests,
                    "seconds": t,
                    "tokens_per_s": args.requests * prompt / t,
                    "model_flops": flops,
                    "flops_per_s": flops / t,
                    "mfu": flops / t / mm["best"],
                }
            )
            r = rows[-1]
            print(
                f"prompt {prompt:>6}: {r['tokens_per_s']:>10.0f} tok/s "
                f"{r['flops_per_s'] / 1e12:8.2f} TFLOP/s  MFU {r['mfu']:.2f}",
                flush=True,
            )
    finally:
        engine.close()
    return {
        "benchmark": "mfu",
        "model": args.model,
        "dtype": str(dtype).removeprefix("torch."),
        "max_batch_tokens": args.batch_tokens,
        "environment": environment(),
        "matmul_flops_per_s": mm,
        "prefill": rows,
        "goal_mfu": 0.5,
        "best_mfu": max(r["mfu"] for r in rows),
    }


def plot(result: dict[str, Any], path: Path) -> Path:
    from bench.lib.plots import plot_bars

    rows = [
        {"name": f"{r['prompt_tokens']} tok", "tflops": r["flops_per_s"] / 1e12}
        for r in result["prefill"]
    ]
    rows.append({"name": "matmul", "tflops": result["matmul_flops_per_s"]["best"] / 1e12})
    title = (
        f"prefill of {result['model']} ({result['dtype']}) on {result['environment']['device']}; "
        f"best MFU {result['best_mfu']:.2f}"
    )
    return plot_bars(rows, "tflops", "TFLOP/s", title, path, fmt="%.3g")


def main(argv: list[str] | None = None) -> int:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser(prog="python -m bench.mfu", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="dummy:llama-2-13b-gqa10")
    ap.add_argument("--device", default=None, help="default: cuda when present")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--prompts", type=ints, default=[512, 2048, 8192], help="prompt lengths")
    ap.add_argument("--requests", type=int, default=4, help="fresh conversations per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-tokens", type=int, default=2048, help="engine max_batch_tokens")
    ap.add_argument("--sizes", type=ints, default=[4096, 8192], help="matmul sizes")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (CPU)")
    ap.add_argument("--out", type=Path, help="JSON path (default bench/results/mfu-<device>.json)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--from-json", type=Path, help="draw the plot of an earlier result")
    args = ap.parse_args(argv)
    if args.from_json:
        print(
            f"wrote {plot(json.loads(args.from_json.read_text()), args.from_json.with_suffix('.png'))}"
        )
        return 0
    result = run(args)
    dev = result["environment"]["device"].split(" (")[0].replace(" ", "-").lower()
    out = args.out or RESULTS / f"mfu-{dev}.json"
    write_json(out, result)
    print(f"matmul {result['matmul_flops_per_s']['best'] / 1e12:.1f} TFLOP/s; wrote {out}")
    if not args.no_plot:
        try:
            print(f"wrote {plot(result, out.with_suffix('.png'))}")
        except ImportError as e:  # a bare GPU machine: plot later where matplotlib is
            print(f"no plot ({e}); draw it with --from-json {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
