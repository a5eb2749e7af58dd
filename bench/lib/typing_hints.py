"""Typing-aware prefetch as a workload of the serving replay (`bench.serve --typing`): users
think a uniform time before each later turn and start typing a uniform lead before sending
(`workload.Plan.lead_s`); the engine is told (as the chat page's `typing` frame does) in
runs with hints on, not in those with them off, on the same schedule. What it measures:
TTFT of the turns that come back to an existing context, and of first turns (which
prefetch must not slow down)."""

from __future__ import annotations

import random
import statistics
from typing import Any

from bench.lib import workload as wl
from bench.lib.metrics import cache_use

# The tiers: the first a quarter of the sample's history, the second an eighth (idle chats
# swap out and drop)
GPU_FRACTION = 0.25
CPU_FRACTION = 0.125
TURN_STATS = (
    "cached_tokens",
    "swapped_in_tokens",
    "recomputed_tokens",
    "prefetched_tokens",
    "queued_s",
)


def plans(convs: list[wl.Conversation], rate: float, think: tuple[float, float],
          lead: tuple[float, float], seed: int) -> list[wl.Plan]:  # fmt: skip
    """Poisson arrivals at `rate`; before each later turn a think time uniform over `think`
    and a typing lead uniform over `lead` (at most the think time)."""
    arrivals = wl.poisson_arrivals(rate, len(convs), seed)
    out = []
    for i, (conv, at) in enumerate(zip(convs, arrivals, strict=True)):
        rng = random.Random(f"prefetch:{seed}:{i}")
        thinks, leads = [], []
        for _ in conv.turns[1:]:
            t = rng.uniform(*think)
            thinks.append(t)
            leads.append(min(rng.uniform(*lead), t))
        out.append(wl.Plan(conv, at, thinks, lead_s=leads))
    return out


def returning(records: list[wl.TurnRecord]) -> dict[str, Any]:
    """TTFT of the turns that come back to an existing context."""
    ok = [r for r in records if r.index > 0 and r.error is None]
    ttft = [r.ttft_s for r in ok]
    queued = [r.stats.get("queued_s", 0.0) for r in ok]
    recomputing = [r.ttft_s for r in ok if r.stats.get("recomputed_tokens", 0)]
    return {
        "turns": len(ok),
        "ttft_mean_s": _mean(ttft),
        "ttft_p50_s": wl.percentile(ttft, 50),
        "ttft_p90_s": wl.percentile(ttft, 90),
        # where TTFT goes: waiting to be scheduled, then computing (recompute, prompt, swap-in)
        "queued_mean_s": _mean(queued),
        "computing_mean_s": _mean([t - q for t, q in zip(ttft, queued, strict=True)]),
        "recomputing_turns": len(recomputing),
        "recomputing_ttft_mean_s": _mean(recomputing),
        "not_recomputing_ttft_mean_s": _mean(
            [r.ttft_s for r in ok if not r.stats.get("recomputed_tokens", 0)]
        ),
        **cache_use(ok, ("prefetched_tokens",)),
    }


def first(records: list[wl.TurnRecord]) -> dict[str, Any]:
    """TTFT of new conversations' first turns: what prefetch must not slow down."""
    ttft = [r.ttft_s for r in records if r.index == 0 and r.error is None]
    return {"turns": len(ttft), "ttft_mean_s": _mean(ttft), "ttft_p50_s": wl.percentile(ttft, 50)}


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def turns(records: list[wl.TurnRecord]) -> list[list]:
    """Each turn: conversation, index, sent and TTFT, then `TURN_STATS`."""
    return [[r.conversation, r.index, round(r.sent_s, 3), round(r.ttft_s, 3)]
            + [round(r.stats.get(k, 0), 3) for k in TURN_STATS] for r in records]  # fmt: skip


def line(run: dict[str, Any]) -> str:
    m, r = run["metrics"], run["returning"]
    return (
        f"typing {'on ' if run['typing'] else 'off'}: returning TTFT mean {r['ttft_mean_s']:.3f}s "
        f"p50 {r['ttft_p50_s']:.3f}s p90 {r['ttft_p90_s']:.3f}s over {r['turns']} turns; "
        f"{m['throughput_tps']:.2f} tok/s {m['throughput_rps']:.3f} req/s; recomputed "
        f"{r['recomputed_tokens']} swapped {r['swapped_in_tokens']} prefetched "
        f"{r['prefetched_tokens']}; queued {r['queued_mean_s']:.3f}s computing "
        f"{r['computing_mean_s']:.3f}s; {r['recomputing_turns']} turns recomputed "
        f"(TTFT {r['recomputing_ttft_mean_s']:.3f}s, others "
        f"{r['not_recomputing_ttft_mean_s']:.3f}s); first turns TTFT "
        f"{run['first']['ttft_mean_s']:.3f}s"
    )


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
