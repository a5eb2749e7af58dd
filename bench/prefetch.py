"""Typing-aware prefetch: TTFT of returning turns with and without `typing` hints.

    python -m bench.prefetch                 # CPU preset, tight tiers, ~14 minutes
    python -m bench.prefetch --conversations 4 --think 3,5 --lead 1,2 --order off,on  # quick

The CPU preset's ShareGPT conversations arrive at `--rate` on an in-process AsyncEngine whose
tiers hold a fraction of their history (idle chats swap out and drop). Users think 12-20 s
before a later turn; with typing on they "start typing" 2-10 s before sending and the engine
is told (`AsyncEngine.prefetch`, as the `typing` frame does). The same schedule runs on fresh
engines in `--order` (off, on, on, off: drift cancels); TTFT of returning and first turns,
throughput and prefetched tokens of each.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.lib import workload as wl
from bench.lib.common import RESULTS, environment, write_json
from bench.lib.drivers import EngineDriver
from bench.lib.metrics import cache_use, counters_delta, metrics
from bench.lib.pools import engine_config, fit_pools, history_chunks, model_args
from bench.lib.presets import MODES, PRESETS
from bench.lib.samples import load_workload

TURN_STATS = (
    "cached_tokens",
    "swapped_in_tokens",
    "recomputed_tokens",
    "prefetched_tokens",
    "queued_s",
)


def schedule(
    convs: list[wl.Conversation],
    rate: float,
    think: tuple[float, float],
    lead: tuple[float, float],
    seed: int,
) -> list[tuple[wl.Conversation, float, list[tuple[float, float]]]]:
    """Per conversation: its arrival and, before each later turn, (think time, typing lead)."""
    arrivals = wl.poisson_arrivals(rate, len(convs), seed)
    out = []
    for i, (conv, at) in enumerate(zip(convs, arrivals, strict=True)):
        rng = random.Random(f"prefetch:{seed}:{i}")
        gaps = []
        for _ in conv.turns[1:]:
            t = rng.uniform(*think)
            gaps.append((t, min(rng.uniform(*lead), t)))
        out.append((conv, at, gaps))
    return out


async def replay(engine, plan, typing: bool, tag: str) -> tuple[list[wl.TurnRecord], float]:
    driver = EngineDriver(engine, tag)
    start = time.monotonic()
    records: list[wl.TurnRecord] = []

    async def run(conv: wl.Conversation, at: float, gaps: list[tuple[float, float]]) -> None:
        await asyncio.sleep(max(0.0, at - (time.monotonic() - start)))
        context = 0
        for i, spec in enumerate(conv.turns):
            if i:
                think, lead = gaps[i - 1]
                await asyncio.sleep(think - lead)
                if typing:  # what the chat page's `typing` frame does
                    engine.prefetch(f"{tag}/{conv.id}")
                await asyncio.sleep(lead)
            sent = time.monotonic() - start
            reply = await driver.send(conv.id, i, spec, context)
            records.append(
                wl.TurnRecord(conv.id, i, sent, reply.first_token_at - start,
                              reply.done_at - start, reply.output_tokens, len(spec.prompt),
                              context, reply.stats, reply.error)
            )  # fmt: skip
            if reply.error is not None:
                return
            context += len(spec.prompt) + reply.output_tokens

    await asyncio.gather(*(run(*p) for p in plan))
    return records, time.monotonic() - start


def returning(records: list[wl.TurnRecord]) -> dict[str, Any]:
    """TTFT of the turns that come back to an existing context."""
    ok = [r for r in records if r.index > 0 and r.error is None]
    ttft = [r.ttft_s for r in ok]
    mean = lambda xs: statistics.fmean(xs) if xs else float("nan")  # noqa: E731
    queued = [r.stats.get("queued_s", 0.0) for r in ok]
    recomputing = [r.ttft_s for r in ok if r.stats.get("recomputed_tokens", 0)]
    return {
        "turns": len(ok),
        "ttft_mean_s": mean(ttft),
        "ttft_p50_s": wl.percentile(ttft, 50),
        "ttft_p90_s": wl.percentile(ttft, 90),
        # where TTFT goes: waiting to be scheduled, then computing (recompute, prompt, swap-in)
        "queued_mean_s": mean(queued),
        "computing_mean_s": mean([t - q for t, q in zip(ttft, queued, strict=True)]),
        "recomputing_turns": len(recomputing),
        "recomputing_ttft_mean_s": mean(recomputing),
        "not_recomputing_ttft_mean_s": mean(
            [r.ttft_s for r in ok if not r.stats.get("recomputed_tokens", 0)]
        ),
        **cache_use(ok, ("prefetched_tokens",)),
    }


def first(records: list[wl.TurnRecord]) -> dict[str, Any]:
    """TTFT of new conversations' first turns: what prefetch must not slow down."""
    ttft = [r.ttft_s for r in records if r.index == 0 and r.error is None]
    return {
        "turns": len(ttft),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else float("nan"),
        "ttft_p50_s": wl.percentile(ttft, 50),
    }


async def bench(args) -> dict[str, Any]:
    from engine import AsyncEngine

    preset = replace(PRESETS["cpu"], conversations=args.conversations)
    convs, workload = load_workload(preset, model_args(preset.model).max_context)
    print(wl.format_summary(workload["summary"]), flush=True)
    preset = fit_pools(replace(preset, gpu_fraction=args.gpu_fraction), convs)
    total = history_chunks(convs)
    cpu = max(1, int(total * args.cpu_fraction))
    preset = replace(preset, cpu_cache_chunks=cpu)
    workload["pools"] = {
        "gpu_cache_chunks": preset.gpu_cache_chunks,
        "cpu_cache_chunks": preset.cpu_cache_chunks,
        "history_chunks": total,
    }
    print(f"pools: {workload['pools']}", flush=True)
    plan = schedule(convs, args.rate, args.think, args.lead, preset.seed)
    runs = []
    for typing in args.order:
        engine = AsyncEngine(engine_config(preset, MODES["pensieve"]))
        await engine.start()
        try:
            tag = "typing" if typing else "plain"
            before = engine.snapshot().counters
            records, wall = await replay(engine, plan, typing, tag)
            await asyncio.sleep(0.6)  # the loop refreshes its snapshot once idle
            counters = counters_delta(before, engine.snapshot().counters)
        finally:
            await engine.stop()
        run = {
            "typing": typing,
            "wall_s": wall,
            "metrics": metrics(records, wall),
            "returning": returning(records),
            "first": first(records),
            "counters": counters,
            "turns": [
                [r.conversation, r.index, round(r.sent_s, 3), round(r.ttft_s, 3)]
                + [round(r.stats.get(k, 0), 3) for k in TURN_STATS]
                for r in records
            ],
        }
        runs.append(run)
        m, r = run["metrics"], run["returning"]
        print(
            f"typing {'on ' if typing else 'off'}: returning TTFT mean {r['ttft_mean_s']:.3f}s "
            f"p50 {r['ttft_p50_s']:.3f}s p90 {r['ttft_p90_s']:.3f}s over {r['turns']} turns; "
            f"{m['throughput_tps']:.2f} tok/s {m['throughput_rps']:.3f} req/s; recomputed "
            f"{r['recomputed_tokens']} swapped {r['swapped_in_tokens']} prefetched "
            f"{r['prefetched_tokens']}; queued {r['queued_mean_s']:.3f}s computing "
            f"{r['computing_mean_s']:.3f}s; {r['recomputing_turns']} turns recomputed "
            f"(TTFT {r['recomputing_ttft_mean_s']:.3f}s, others "
            f"{r['not_recomputing_ttft_mean_s']:.3f}s); first turns TTFT "
            f"{run['first']['ttft_mean_s']:.3f}s",
            flush=True,
        )
    return {
        "preset": {
            "name": "cpu",
            "model": preset.model,
            "conversations": len(convs),
            "rate": args.rate,
            "think_s": list(args.think),
            "typing_lead_s": list(args.lead),
            "gpu_fraction": args.gpu_fraction,
            "cpu_fraction": args.cpu_fraction,
            "max_batch_tokens": preset.max_batch_tokens,
            "threads": preset.threads,
        },
        "workload": workload,
        "runs": runs,
        "summary": summarize(runs),
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over runs of each kind; the change typing hints make."""
    out: dict[str, Any] = {}
    for typing in (False, True):
        rs = [r for r in runs if r["typing"] == typing]
        if not rs:
            return out
        key = "typing" if typing else "plain"
        out[key] = {
            k: statistics.fmean(r["returning"][k] for r in rs)
            for k in ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s")
        }
        for k in ("throughput_tps", "throughput_rps"):
            out[key][k] = statistics.fmean(r["metrics"][k] for r in rs)
        out[key]["first_ttft_mean_s"] = statistics.fmean(r["first"]["ttft_mean_s"] for r in rs)
    p, t = out["plain"], out["typing"]
    out["ttft_mean_change"] = t["ttft_mean_s"] / p["ttft_mean_s"] - 1
    out["ttft_p50_change"] = t["ttft_p50_s"] / p["ttft_p50_s"] - 1
    out["first_ttft_mean_change"] = t["first_ttft_mean_s"] / p["first_ttft_mean_s"] - 1
    out["throughput_tps_change"] = t["throughput_tps"] / p["throughput_tps"] - 1
    return out


def plot(result: dict[str, Any], path: Path) -> Path:
    from bench.lib.plots import plt, save_fig

    s = result["summary"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    keys = [("ttft_mean_s", "mean"), ("ttft_p50_s", "median"), ("ttft_p90_s", "p90")]
    xs = range(len(keys))
    for off, kind, color in ((-0.2, "plain", "tab:gray"), (0.2, "typing", "tab:red")):
        label = "no typing hints" if kind == "plain" else "typing 2-10 s before"
        a.bar([x + off for x in xs], [s[kind][k] for k, _ in keys], 0.4, color=color, label=label)
        b.bar([off], [s[kind]["throughput_tps"]], 0.4, color=color, label=label)
    a.set_xticks(list(xs), [n for _, n in keys])
    a.set_ylabel("TTFT of returning turns (s)")
    a.legend()
    b.set_xticks([])
    b.set_ylabel("output tokens / s")
    env = result["environment"]
    fig.suptitle(
        f"Typing-aware prefetch, CPU preset ({env['device']}, {env['git_commit'][:12]}): "
        f"TTFT {s['ttft_mean_change']:+.0%}, throughput {s['throughput_tps_change']:+.1%}",
        fontsize=9,
    )
    return save_fig(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    pair = lambda s: tuple(float(x) for x in s.split(","))  # noqa: E731
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--rate", type=float, default=0.05, help="new conversations per second")
    ap.add_argument("--think", type=pair, default=(12.0, 20.0), help="min,max think time (s)")
    ap.add_argument("--lead", type=pair, default=(2.0, 10.0), help="min,max typing lead (s)")
    ap.add_argument("--gpu-fraction", type=float, default=0.25)
    ap.add_argument("--cpu-fraction", type=float, default=0.125)
    ap.add_argument(
        "--order",
        default="off,on,on,off",
        help="runs in this order (off: no typing hints, on: hints)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "prefetch_cpu.json")
    args = ap.parse_args(argv)
    args.order = [x.strip() == "on" for x in args.order.split(",")]

    import torch

    torch.set_num_threads(PRESETS["cpu"].threads or torch.get_num_threads())
    env = environment("cpu")
    result = asyncio.run(bench(args))
    result["environment"] = env
    write_json(args.out, result)
    print(f"wrote {args.out} and {plot(result, args.out.with_suffix('.png'))}")
    s = result["summary"]
    print(
        f"returning TTFT mean {s['plain']['ttft_mean_s']:.3f}s -> {s['typing']['ttft_mean_s']:.3f}s "
        f"({s['ttft_mean_change']:+.1%}); first turns {s['first_ttft_mean_change']:+.1%}; "
        f"throughput {s['throughput_tps_change']:+.1%}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
