"""Swap bandwidth and overlap: how close chunk swaps come to the pinned-memory copy rate, and
how much of the layer-by-layer swap-in hides behind compute.

    python -m bench.swap                       # CUDA: dummy:llama-2-13b-gqa10, bfloat16
    python -m bench.swap --model dummy:tiny --device cpu --chunks 16   # plumbing check

Writes bench/results/swap-<device>.json (medians of CUDA events). `scattered`: single-block
runs through the block-copy kernel and run by run, each direction; `choice` names the faster
way per direction as the `PENSIEVE_SWAP_COPY` setting; `host_s` is the host's time to issue
a swap.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from bench.lib.common import RESULTS, device_name, environment, git_commit, write_json
from engine.cache.profile import timed
from engine.copies import CopyPlan
from engine.kv_pool import KVPool, kernel_copies_work
from engine.model.loader import load
from engine.model.shapes import DUMMY_SHAPES
from kernels import AttentionMetadata


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def scattered_rates(
    shape, chunk_size: int, device: torch.device, dtype, n: int, repeats: int
) -> dict[str, dict[str, float]]:
    """GB/s of `n` chunks scattered on both sides (every run one block), GPU -> host ("out")
    and host -> GPU ("in"), per way: the block-copy kernel (where it copies exactly) and run
    by run on the copy engine ("dma"); with the host's seconds to issue each swap."""
    pool = KVPool(shape, n, n, chunk_size, device, dtype)
    total = n * KVPool.bytes_per_block(shape, chunk_size, dtype)
    rng = random.Random(0)
    out_pairs = list(zip(rng.sample(range(n), n), rng.sample(range(n), n), strict=True))
    in_pairs = [(c, g) for g, c in out_pairs]
    ways = ["dma"] + (["kernel"] if device.type == "cuda" and kernel_copies_work(device) else [])
    result: dict[str, dict[str, float]] = {}
    for way in ways:
        pool.copy_kernel = way == "kernel"
        for d, plan in (("out", CopyPlan(swap_out=out_pairs)), ("in", CopyPlan(swap_in=in_pairs))):
            host: list[float] = []

            def swap(plan: CopyPlan = plan, host: list[float] = host) -> None:
                t = time.perf_counter()
                pool.begin_step(plan)
                pool.swap_in_now()
                host.append(time.perf_counter() - t)
                pool.end_step(CopyPlan())
                sync(device)

            t = timed(swap, device, repeats)
            result[f"{d}_{way}"] = {
                "GBps": total / t / 1e9,
                "seconds": t,
                "host_s": statistics.median(host),
            }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="dummy:llama-2-13b-gqa10")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--chunks", type=int, default=256, help="chunks swapped per measurement")
    ap.add_argument(
        "--batch-tokens", type=int, default=2048, help="prompt tokens of the overlapped forward"
    )
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    default = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = getattr(torch, args.dtype) if args.dtype else default
    if args.model.startswith("dummy:") and args.model.split(":", 1)[1] not in DUMMY_SHAPES:
        raise SystemExit(f"unknown dummy shape in {args.model}")
    loaded = load(args.model, device, dtype)
    shape, model = loaded.args, loaded.model
    cs, n = 32, args.chunks
    ctx_blocks = -(-args.batch_tokens // cs)
    pool = KVPool(shape, n + ctx_blocks, n, cs, device, dtype)
    chunk_bytes = KVPool.bytes_per_block(shape, cs, dtype)
    total = n * chunk_bytes

    # Baseline: one pinned host buffer of the same size copied in one go.
    host = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.empty(total, dtype=torch.uint8, device=device)
    h2d = timed(lambda: dev.copy_(host, non_blocking=True), device, args.repeats)
    d2h = timed(lambda: host.copy_(dev, non_blocking=True), device, args.repeats)

    # Contiguous: one run of n blocks each way (the copy engine's best case). Scattered: the
    # blocks shuffled on both sides, every run one block, as swaps in serving mostly are;
    # through the block-copy kernel and, for comparison, run by run.
    rng = random.Random(0)
    contiguous = [(i, i) for i in range(n)]
    scattered = list(zip(rng.sample(range(n), n), rng.sample(range(n), n), strict=True))

    # Overlap: a prefill of batch_tokens over its own blocks while n chunks swap in.
    t_tok = args.batch_tokens
    blocks = list(range(n, n + ctx_blocks))
    meta = AttentionMetadata.build([t_tok], [0], [blocks], device)
    ids = torch.randint(0, shape.vocab_size, (t_tok,), device=device)
    pos = torch.arange(t_tok, device=device)
    slots = torch.tensor([blocks[i // cs] * cs + i % cs for i in range(t_tok)], device=device)
    rows = torch.tensor([t_tok - 1], device=device)

    def forward(plan: CopyPlan) -> None:
        pool.begin_step(plan)
        model(ids, pos, pool.layers, meta, slots, rows, before_attention=pool.before_attention)
        pool.end_step(CopyPlan())
        sync(device)

    def measure(out_pairs: list[tuple[int, int]], kernel: bool) -> dict[str, float]:
        pool.copy_kernel = kernel
        host = {"out": [], "in": []}
        in_pairs = [(c, g) for g, c in out_pairs]

        def swap_out() -> None:
            t = time.perf_counter()
            pool.begin_step(CopyPlan(swap_out=out_pairs))
            host["out"].append(time.perf_counter() - t)
            sync(device)

        def swap_in() -> None:
            t = time.perf_counter()
            pool.begin_step(CopyPlan(swap_in=in_pairs))
            host["in"].append(time.perf_counter() - t)
            for layer in range(shape.n_layers):
                pool.before_attention(layer)
            pool.end_step(CopyPlan())
            sync(device)

        t_out = timed(swap_out, device, args.repeats)
        t_in = timed(swap_in, device, args.repeats)
        t_both = timed(lambda: forward(CopyPlan(swap_in=in_pairs)), device, args.repeats)
        return {
            "swap_in_s": t_in,
            "swap_out_s": t_out,
            "forward_with_swap_in_s": t_both,
            "swap_in_host_s": statistics.median(host["in"]),
            "swap_out_host_s": statistics.median(host["out"]),
        }

    # Both ways are measured whatever PENSIEVE_SWAP_COPY chose (where the kernel copies exactly)
    kernel_ok = device.type == "cuda" and kernel_copies_work(device)
    t_fwd = timed(lambda: forward(CopyPlan()), device, args.repeats)
    runs = measure(contiguous, kernel_ok)  # one run: copied run by run whatever the setting
    t_in, t_out, t_both = runs["swap_in_s"], runs["swap_out_s"], runs["forward_with_swap_in_s"]
    spread = {"run_by_run": measure(scattered, False)}
    if kernel_ok:
        spread["kernel"] = measure(scattered, True)
    for r in spread.values():
        r["swap_in_GBps"] = total / r["swap_in_s"] / 1e9
        r["swap_out_GBps"] = total / r["swap_out_s"] / 1e9
        r["swap_in_exposed_s"] = max(0.0, r["forward_with_swap_in_s"] - t_fwd)
    pool.copy_kernel = kernel_ok
    # Per direction, the faster way over the scattered blocks ("dma": run by run)
    fastest = {
        d: min(spread, key=lambda way, d=d: spread[way][f"swap_{d}_s"]) for d in ("out", "in")
    }
    choice = {d: "kernel" if way == "kernel" else "dma" for d, way in fastest.items()}
    exposed = max(0.0, t_both - t_fwd)
    result = {
        "device": device_name(device),
        "commit": git_commit(),
        "environment": environment(device),
        "torch": torch.__version__,
        "model": args.model,
        "dtype": str(dtype).removeprefix("torch."),
        "chunk_bytes": chunk_bytes,
        "chunks": n,
        "pinned_h2d_GBps": total / h2d / 1e9,
        "pinned_d2h_GBps": total / d2h / 1e9,
        "swap_in_GBps": total / t_in / 1e9,
        "swap_out_GBps": total / t_out / 1e9,
        "swap_in_fraction_of_pinned": h2d / t_in,
        "swap_out_fraction_of_pinned": d2h / t_out,
        "forward_s": t_fwd,
        "forward_with_swap_in_s": t_both,
        "swap_in_s": t_in,
        "swap_in_hidden_share": 1.0 - min(1.0, exposed / t_in),
        "copy_kernel": kernel_ok,
        "scattered": spread,
        "choice": choice,
        "choice_setting": f"PENSIEVE_SWAP_COPY=out={choice['out']},in={choice['in']}",
    }
    print(json.dumps(result, indent=2))
    name = result["device"].replace(" ", "_")
    write_json(Path(args.out) if args.out else RESULTS / f"swap-{name}.json", result, indent=2)


if __name__ == "__main__":
    main()
