"""Tensor parallelism's cost: step time per rank count, the all-reduce per layer, and the
per-step message, on CUDA (NCCL) or the CPU (gloo).

    python -m bench.tp --device cuda   # bench/results/tp-<gpu>.json and .png, about a minute
    python -m bench.tp --device cpu    # dummy:tiny, 1 and 2 ranks: bench/results/tp-cpu.json

Rows, same workload and weights: `plain` (tensor_parallel=1; on the CPU with all cores and
with one thread), `TP=1` (the tensor-parallel path forced on one rank: its own cost), `TP=N`
for N = 2, 4 where there are N GPUs (the CPU: 2) and the shape divides. Each row: rounds of
`--convs` conversations, ms per engine step, and rank 0's time sending Step messages. Then
the all-reduce of a [tokens, dim] activation per rank count (two a layer). CUDA graphs off.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.lib.common import RESULTS, environment
from bench.lib.harness import free_port
from engine import Engine, EngineConfig, SamplingParams, Turn
from engine.model.loader import model_args
from engine.model.shard import check_divisible
from engine.parallel import Step

DEFAULTS = {  # per device: model, convs, prompt, output, rounds, dtype
    "cuda": ("dummy:llama-2-7b", 16, 256, 64, 2, "bfloat16"),
    "cpu": ("dummy:tiny", 4, 64, 32, 3, "float32"),
}
FIELDS = (("model", str), ("convs", int), ("prompt", int), ("output", int), ("rounds", int),
          ("dtype", str))  # fmt: skip
ALL_REDUCE_TOKENS = (1, 16, 256, 2048)


def rank_counts(model: str, device: str) -> list[int]:
    """1, then 2 and 4 where there are that many GPUs (the CPU: 2) and the shape divides."""
    most = torch.cuda.device_count() if device == "cuda" else 2
    return [1] + [n for n in (2, 4) if n <= most and divides(model, n)]


def divides(model: str, n: int) -> bool:
    try:
        check_divisible(model_args(model), n)
        return True
    except ValueError:
        return False


def run_engine(a, name: str, tp: int, force: bool, threads: int | None = None) -> dict:
    if threads:  # the CPU: this process's threads (ranks set their own, cores / ranks each)
        torch.set_num_threads(threads)
    engine = Engine(EngineConfig(
        model=a.model, device=a.device, dtype=a.dtype, gpu_cache_chunks=a.chunks,
        cpu_cache_chunks=0, eviction="lru",  # no cost profile to build: it fits the GPU tier
        cuda_graphs=False, tensor_parallel=tp, force_tensor_parallel=force,
    ))  # fmt: skip
    try:
        sp = SamplingParams(max_tokens=a.output, ignore_eos=True)
        ids = [100 + (7 * i) % 5000 for i in range(a.prompt)]
        engine.run([Turn(f"warm{i}", ids, sp) for i in range(a.convs)])  # warm-up, compiles
        tp_link, sent = engine.backend.tp, {"s": 0.0, "n": 0, "bytes": []}
        if tp_link is not None:
            send = tp_link.send

            def timed_send(msg) -> None:
                if len(sent["bytes"]) < 100:  # a sample of the sizes (pickling costs too)
                    sent["bytes"].append(len(pickle.dumps(msg)))
                t = time.perf_counter()
                send(msg)
                sent["s"] += time.perf_counter() - t
                sent["n"] += 1

            tp_link.send = timed_send
        sync(a.device)
        steps0, t = engine.counters.steps, time.perf_counter()
        for r in range(a.rounds):
            engine.run([Turn(f"c{r}-{i}", ids, sp) for i in range(a.convs)])
        sync(a.device)
        wall, steps = time.perf_counter() - t, engine.counters.steps - steps0
        row = {"name": name, "tensor_parallel": tp, "parallel_path": tp_link is not None,
               "wall_s": round(wall, 3), "steps": steps,
               "ms_per_step": round(1e3 * wall / steps, 3),
               "tokens_per_s": round(a.rounds * a.convs * a.output / wall, 1)}  # fmt: skip
        if tp_link is not None:
            tp_link.send = send
            row["message_ms_per_step"] = round(1e3 * sent["s"] / max(1, steps), 3)
            row["messages"] = sent["n"]
            row["message_bytes_mean"] = round(statistics.mean(sent["bytes"]))
            t = time.perf_counter()
            for _ in range(200):
                send(Step([], None))
            row["empty_message_ms"] = round(1e3 * (time.perf_counter() - t) / 200, 3)
        return row
    finally:
        engine.close()
        del engine
        gc.collect()  # the engine's weights and pools go before the next row's come
        if a.device == "cuda":
            torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---- the all-reduce alone, in processes of its own ----


def _all_reduce_rank(rank: int, world: int, port: int, device: str, dim: int, dtype, out) -> None:
    cuda = device == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
        world_size=world, timeout=timedelta(seconds=60), **({"device_id": dev} if cuda else {}),
    )  # fmt: skip
    try:
        result = {}
        for tokens in ALL_REDUCE_TOKENS:
            x = torch.randn(tokens, dim, device=dev, dtype=dtype)
            reps = 50 if cuda else 20
            for _ in range(5):
                dist.all_reduce(x)
            sync(device)
            dist.barrier()
            t = time.perf_counter()
            for _ in range(reps):
                dist.all_reduce(x)
            sync(device)
            result[tokens] = (time.perf_counter() - t) / reps
        if rank == 0:
            out.put(result)
    finally:
        dist.destroy_process_group()


def all_reduce_cost(world: int, device: str, dim: int, dtype) -> dict:
    """Microseconds per all-reduce of [tokens, dim] (back to back, host time), and per layer."""
    ctx = mp.get_context("spawn")
    out, port = ctx.SimpleQueue(), free_port()
    procs = [ctx.Process(target=_all_reduce_rank, args=(r, world, port, device, dim, dtype, out))
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    if out.empty():
        return {"ranks": world, "error": "the all-reduce processes returned nothing"}
    got = out.get()
    return {"ranks": world,
            "us_per_all_reduce": {str(t): round(1e6 * s, 1) for t, s in got.items()},
            "us_per_layer": {str(t): round(2e6 * s, 1) for t, s in got.items()}}  # fmt: skip


def plot(result: dict, path: Path) -> None:
    from bench.lib.plots import plt

    rows, env = result["rows"], result["environment"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["name"] for r in rows]
    a.bar_label(a.bar(names, [r["ms_per_step"] for r in rows], color="tab:green"), fmt="%.2f",
                fontsize=8)  # fmt: skip
    msg = [r.get("message_ms_per_step", 0.0) for r in rows]
    a.bar(names, msg, color="tab:orange", label="of which: Step message")
    a.set_ylabel("ms per engine step")
    for c in (c for c in result["all_reduce"] if "us_per_layer" in c):
        xs = [int(t) for t in c["us_per_layer"]]
        b.plot(xs, list(c["us_per_layer"].values()), marker="o", label=f"{c['ranks']} ranks")
    b.set(xscale="log", yscale="log", xlabel="tokens in the step",
          ylabel="µs per layer (2 all-reduces)")  # fmt: skip
    for ax in (a, b):
        ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"{result['model']} {result['config']['dtype']} on {env['device']} "
                 f"({env['git_commit'][:10]})", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    for name, kind in FIELDS:  # unset: the device's default (DEFAULTS)
        p.add_argument(f"--{name}", type=kind)
    p.add_argument("--chunks", type=int, default=256, help="GPU-tier chunks of each rank")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here")
    for (name, _), default in zip(FIELDS, DEFAULTS[a.device], strict=True):
        setattr(a, name, getattr(a, name) or default)
    env = environment(a.device)
    tag = env["device"].split(" (")[0].lower().replace(" ", "-")
    a.out = a.out or RESULTS / f"tp-{tag}.json"
    counts = rank_counts(a.model, a.device)
    cores = os.cpu_count() or 1
    if a.device == "cpu":
        rows = [run_engine(a, f"plain {cores} threads", 1, False, cores)]
        rows += [run_engine(a, "plain 1 thread", 1, False, 1)]
        torch.set_num_threads(cores)
    else:
        rows = [run_engine(a, "plain", 1, False)]
    rows += [run_engine(a, f"TP={n}", n, True) for n in counts]
    dim, dtype = model_args(a.model).dim, getattr(torch, a.dtype)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    result = {"benchmark": "tp", "model": a.model, "config": config, "environment": env,
              "rows": rows,
              "all_reduce": [all_reduce_cost(n, a.device, dim, dtype) for n in counts]}  # fmt: skip
    by = {r["name"]: r["ms_per_step"] for r in rows}
    plain = by.get("plain 1 thread", by.get("plain"))
    result["tp1_path_over_plain"] = round(by["TP=1"] / plain, 3)
    if "TP=2" in by:
        result["tp2_over_plain"] = round(by["TP=2"] / plain, 3)
    if a.device == "cpu":
        result["load_avg"] = os.getloadavg()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2))
    plot(result, a.out.with_suffix(".png"))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
