"""The CPU cost of tensor parallelism: one rank against two (gloo) on the same cores.

    python -m bench.tp_cpu            # writes bench/results/tp_cpu.json and .png

On one machine two ranks share the cores the single rank had, and every forward adds the
step message (a gloo broadcast of the batch and copy plans) and two all-reduces per layer
plus a logit all-gather: this measures that overhead, not a speed-up. Rounds of 4
conversations (a prompt of `--prompt` tokens, then `--output` generated tokens each, ignoring
EOS) on dummy:tiny; reported per engine step (prefill and decode steps together) and, for
two ranks, the cost of an empty step message alone.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from bench.lib.common import RESULTS, environment
from engine import Engine, EngineConfig, SamplingParams, Turn


def run(tp: int, rounds: int, prompt: int, output: int, convs: int, threads: int) -> dict:
    torch.set_num_threads(threads)  # two ranks set their own: cores / ranks each
    engine = Engine(
        EngineConfig(model="dummy:tiny", device="cpu", gpu_cache_chunks=256, tensor_parallel=tp)
    )
    try:
        sp = SamplingParams(max_tokens=output, ignore_eos=True)
        ids = list(range(100, 100 + prompt))
        engine.run([Turn(f"warm{i}", ids, sp) for i in range(convs)])  # warm-up
        steps0 = engine.counters.steps
        t = time.perf_counter()
        for _ in range(rounds):
            engine.run([Turn(f"c{i}", ids, sp) for i in range(convs)])
        wall = time.perf_counter() - t
        steps = engine.counters.steps - steps0
        row = {
            "name": f"TP={tp}",
            "tensor_parallel": tp,
            "wall_s": round(wall, 3),
            "steps": steps,
            "ms_per_step": round(1e3 * wall / steps, 2),
            "tokens_per_s": round(rounds * convs * output / wall, 1),
        }
        if engine.backend.tp is not None:
            from engine.parallel import Step

            n = 200
            t = time.perf_counter()
            for _ in range(n):
                engine.backend.tp.send(Step([], None))
            row["empty_message_ms"] = round(1e3 * (time.perf_counter() - t) / n, 3)
        return row
    finally:
        engine.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--convs", type=int, default=4)
    p.add_argument("--out", type=Path, default=RESULTS / "tp_cpu.json")
    a = p.parse_args()
    # One rank with all the cores and with one core (on a loaded machine, intra-op threads
    # waiting for each other can cost more than the work), then two ranks of one core each.
    cores = os.cpu_count() or 1
    rows = [
        run(tp, a.rounds, a.prompt, a.output, a.convs, threads)
        for tp, threads in ((1, cores), (1, 1), (2, cores))
    ]
    rows[0]["name"], rows[1]["name"] = f"TP=1 {cores} threads", "TP=1 1 thread"
    result = {
        "benchmark": "tp_cpu",
        "model": "dummy:tiny",
        "config": vars(a) | {"out": str(a.out)},
        "environment": environment("cpu"),
        "rows": rows,
        "load_avg": os.getloadavg(),
        "tp2_over_tp1_1_thread": round(rows[2]["ms_per_step"] / rows[1]["ms_per_step"], 2),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2))
    from bench.lib.plots import plot_bars

    plot_bars(
        rows,
        "ms_per_step",
        "ms per engine step",
        f"dummy:tiny, CPU, {cores} cores: 1 rank vs 2 (gloo)",
        a.out.with_suffix(".png"),
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
