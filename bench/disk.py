"""The disk tier: time to first token of conversations that come back after a restart.

    python -m bench.disk --convs 6 --context 1024

A first engine builds `--convs` conversations of about `--context` tokens, then stops
gracefully (memory written to the disk tier). Fresh engines on the same history serve one
more turn of each, one at a time: `recompute` (no disk tier), `disk` (chunks read back where
cheaper than recomputing), and on a disk throttled to `--slow-mb-s` the cost rule, always
load and always recompute. The files sit in the page cache: unthrottled is host memory
speed. JSON and a bar plot in bench/results/.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.lib.common import RESULTS, environment, write_json
from engine import Engine, EngineConfig, SamplingParams, Turn

MODEL = "smollm2-135m-instruct"


def build(disk: Path, convs: int, context: int, seed: int) -> tuple[Engine, list[list[int]]]:
    """An engine holding `convs` conversations of about `context` tokens, stopped: its
    memory is written to the disk tier."""
    engine = Engine(
        EngineConfig(model=MODEL, device="cpu", disk_cache_dir=str(disk), gpu_cache_chunks=512)
    )
    rng = random.Random(seed)
    vocab = engine.tokenizer.vocab_size
    contexts: list[list[int]] = [[] for _ in range(convs)]
    sp = SamplingParams(max_tokens=32, ignore_eos=True)
    while min(len(c) for c in contexts) < context:
        turns = [
            Turn(f"c{i}", [rng.randrange(100, vocab) for _ in range(224)], sp, context_len=len(c))
            for i, c in enumerate(contexts)
        ]
        for i, r in enumerate(engine.run(turns)):
            contexts[i] += turns[i].prompt_token_ids + r.token_ids
    t0 = time.perf_counter()
    written = engine.write_back()
    write_s = time.perf_counter() - t0
    engine.close()
    print(f"built {convs} conversations of {len(contexts[0])} tokens; wrote {written} chunks "
          f"in {write_s:.2f} s")  # fmt: skip
    return engine, contexts


def returning(
    history, contexts, disk: Path | None, choice: str = "cost", limit: float | None = None
) -> dict:
    """A fresh engine on the same history: one more turn of each conversation, one at a
    time; time to first token and where the context came from."""
    config = EngineConfig(
        model=MODEL, device="cpu", gpu_cache_chunks=512,
        disk_cache_dir=str(disk) if disk else None,
    )  # fmt: skip
    engine = Engine(config, history=history)
    if engine.disk is not None:
        engine.disk.store.choice = choice
        engine.disk.store.read_limit_bps = limit
        engine.disk.store._probe()  # the bandwidth the cost rule starts from, throttle included
    rng = random.Random(1)
    ttft, disk_tokens, recomputed = [], 0, 0
    for i, context in enumerate(contexts):
        prompt = [rng.randrange(100, 40000) for _ in range(16)]
        turn = Turn(f"c{i}", prompt, SamplingParams(max_tokens=1), context_len=len(context))
        [r] = engine.run([turn])
        ttft.append(r.stats.first_token_s - r.stats.arrival_s)
        disk_tokens += r.stats.disk_tokens
        recomputed += r.stats.recomputed_tokens
    engine.close()
    return {
        "ttft_ms_median": statistics.median(ttft) * 1000,
        "ttft_ms": [round(x * 1000, 1) for x in ttft],
        "disk_tokens": disk_tokens,
        "recomputed_tokens": recomputed,
    }


def plot(result: dict, path: Path) -> None:
    from bench.lib.plots import plt, save_fig

    rows = result["runs"]
    fig, ax = plt.subplots(figsize=(9, 4))
    bars = ax.bar([r["name"] for r in rows], [r["ttft_ms_median"] for r in rows],
                  color=["tab:gray", "tab:blue", "tab:red", "tab:green", "tab:orange"])  # fmt: skip
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_ylabel("time to first token after a restart (ms, median)")
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    env = result["environment"]
    ax.set_title(f"{result['convs']} conversations of {result['context']} tokens, {MODEL} on "
                 f"{env['device']} ({env['git_commit'][:9]})", fontsize=9)  # fmt: skip
    save_fig(fig, path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--convs", type=int, default=6)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--slow-mb-s", type=float, default=10.0)
    p.add_argument("--out", type=Path, default=RESULTS / "disk-cpu.json")
    args = p.parse_args(argv)
    slow = args.slow_mb_s * 1e6
    with tempfile.TemporaryDirectory() as tmp:
        disk = Path(tmp)
        first, contexts = build(disk, args.convs, args.context, seed=0)
        history = first.history
        variants = [
            ("recompute (no disk tier)", None, "cost", None),
            ("disk tier", disk, "cost", None),
            (f"{args.slow_mb_s:g} MB/s: always recompute", disk, "recompute", slow),
            (f"{args.slow_mb_s:g} MB/s: cost rule", disk, "cost", slow),
            (f"{args.slow_mb_s:g} MB/s: always load", disk, "load", slow),
        ]
        runs = []
        for name, d, choice, limit in variants:
            r = {"name": name, **returning(history, contexts, d, choice, limit)}
            runs.append(r)
            print(f"{name:30s} TTFT {r['ttft_ms_median']:8.1f} ms median; from disk "
                  f"{r['disk_tokens']}, recomputed {r['recomputed_tokens']}")  # fmt: skip
    result = {"benchmark": "disk", "convs": args.convs, "context": len(contexts[0]),
              "slow_mb_s": args.slow_mb_s, "environment": environment(), "runs": runs}  # fmt: skip
    write_json(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
