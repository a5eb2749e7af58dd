"""What a run measured: throughput, normalized latency, TTFT, cache use; where a mode's
latency crosses its bound (its capacity), and the claims compared across modes."""

from __future__ import annotations

import statistics
from dataclasses import asdict
from typing import Any

from bench.lib import workload as wl


def metrics(records: list[wl.TurnRecord], wall_s: float) -> dict[str, Any]:
    """Throughput, normalized latency (latency / output tokens), TTFT and cache hits of a run."""
    ok = [r for r in records if r.error is None and r.output_tokens > 0]
    span = max((r.done_s for r in ok), default=0.0) - min((r.sent_s for r in ok), default=0.0)
    span = span or wall_s or 1e-9
    norm = [r.latency_s / r.output_tokens for r in ok]
    ttft = [r.ttft_s for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "turns": len(ok),
        "errors": len(records) - len(ok),
        "error_samples": sorted({r.error for r in records if r.error})[:3],
        "duration_s": span,
        "throughput_rps": len(ok) / span,
        "throughput_tps": out_tokens / span,
        "output_tokens": out_tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "norm_latency_mean": statistics.fmean(norm) if norm else float("nan"),
        "norm_latency_p50": wl.percentile(norm, 50),
        "norm_latency_p90": wl.percentile(norm, 90),
        "latency_mean_s": statistics.fmean(r.latency_s for r in ok) if ok else float("nan"),
        "ttft_p50_s": wl.percentile(ttft, 50),
        "ttft_p90_s": wl.percentile(ttft, 90),
        **cache_use(ok, ("suspensions",)),
    }


def steady_metrics(records: list[wl.TurnRecord], start: float, end: float) -> dict[str, Any]:
    """`metrics` of the turns sent in [start, end): the steady state of a run whose
    conversations keep arriving until `end`, past the ramp-up before `start`. Throughput is
    those turns over the window's length."""
    inside = [r for r in records if start <= r.sent_s < end]
    m = metrics(inside, end - start)
    ok = [r for r in inside if r.error is None and r.output_tokens > 0]
    m["duration_s"] = end - start
    m["throughput_rps"] = len(ok) / (end - start)
    m["throughput_tps"] = sum(r.output_tokens for r in ok) / (end - start)
    m["window_s"] = [start, end]
    return m


def window_metrics(records: list[wl.TurnRecord], wall: float) -> dict[str, Any]:
    """`metrics` of the completed turns; normalized latency over the cancelled ones too,
    each counted at its lower bound, so an overloaded run is not made to look faster."""
    done = [r for r in records if not r.stats.get("censored")]
    cut = [r for r in records if r.stats.get("censored")]
    m = metrics(done, wall)
    norm = [
        r.latency_s / r.output_tokens for r in done + cut if r.error is None and r.output_tokens
    ]
    m["norm_latency_mean_completed"] = m["norm_latency_mean"]
    m["norm_latency_mean"] = statistics.fmean(norm) if norm else float("nan")
    m["norm_latency_p90"] = wl.percentile(norm, 90)
    m["cancelled_at_drain"] = len(cut)
    return m


TURN_COLUMNS = ("conversation", "index", "sent_s", "ttft_s", "latency_s", "output_tokens",
                "context_tokens", "cut", "error")  # fmt: skip


def turn_table(records: list[wl.TurnRecord]) -> dict[str, Any]:
    """Every turn of a run, compactly (times in ms): a real run and its simulated twin can
    then be compared turn by turn, not only by their means (one window near saturation is
    one draw of which turns queue and which are cut)."""
    rows = [[r.conversation, r.index, round(r.sent_s * 1e3), round(r.ttft_s * 1e3),
             round(r.latency_s * 1e3), r.output_tokens, r.context_tokens,
             int(bool(r.stats.get("censored"))), int(r.error is not None)]
            for r in sorted(records, key=lambda r: r.sent_s)]  # fmt: skip
    return {"columns": list(TURN_COLUMNS), "times": "ms", "rows": rows}


def cache_use(ok: list[wl.TurnRecord], extra: tuple[str, ...] = ()) -> dict[str, int]:
    """Context tokens of the turns, and how much of it each way of keeping KV supplied."""
    keys = ("cached_tokens", "swapped_in_tokens", "recomputed_tokens", "disk_tokens", *extra)
    out = {"context_tokens": sum(r.context_tokens for r in ok)}
    out.update({k: int(sum(r.stats.get(k, 0) for r in ok)) for k in keys})
    return out


def counters_delta(before, after) -> dict[str, int]:
    """What the engine's counters (`EngineCounters`) grew by between two snapshots."""
    a, b = asdict(after), asdict(before)
    return {k: a[k] - b[k] for k in a if k not in ("running", "waiting")}


def crossing(runs: list[dict[str, Any]], bound: float, key: str = "norm_latency_mean") -> dict:
    """Where one mode's latency (`key`) reaches `bound` as its rate grows.

    Runs are taken in rate order; the first whose latency is over the bound is the crossing.
    Capacity = the throughput linearly interpolated between the last run under the bound and
    that one, in latency. A run that refused turns (errors) and stayed under the bound says
    nothing (the load it refused might have taken it over): it is left out and listed in
    `unmeasured_rates`; one that refused turns and is over the bound anyway is over. Not
    crossed: no capacity, only `at_least_rps`, the best throughput under the bound (a lower
    bound on it). Crossed at the lowest rate: no capacity (it is under every throughput
    measured)."""
    pts = sorted((r for r in runs if r["metrics"]["turns"]), key=lambda r: r["rate"])
    unmeasured = [r["rate"] for r in pts if r["metrics"]["errors"] and r["metrics"][key] <= bound]
    pts = [r for r in pts if r["rate"] not in unmeasured]
    out: dict[str, Any] = {"crossed": False, "over_rate": None, "under_rate": None,
                           "capacity_rps": None, "at_least_rps": None}  # fmt: skip
    if unmeasured:
        out["unmeasured_rates"] = unmeasured
    under = None
    for r in pts:
        m = r["metrics"]
        lat, tp = m[key], m["throughput_rps"]
        if lat <= bound:
            under = r
            continue
        out.update(crossed=True, over_rate=r["rate"])
        if under is None:
            return out
        u = under["metrics"]
        out["under_rate"] = under["rate"]
        if lat <= u[key]:  # no slope to interpolate along
            out["capacity_rps"] = u["throughput_rps"]
        else:
            share = (bound - u[key]) / (lat - u[key])
            out["capacity_rps"] = u["throughput_rps"] + share * (tp - u["throughput_rps"])
        return out
    # Never over the bound: the most it served under it, plus what the refusing runs served.
    served = [r["metrics"]["throughput_rps"] for r in runs if r["metrics"]["turns"]]
    out["under_rate"] = under["rate"] if under else None
    out["at_least_rps"] = max(served, default=None)
    return out


def capacity_text(c: dict[str, Any]) -> str:
    """A crossing in words: `2.15 req/s`, `at least 1.50 req/s`, or `over at the lowest rate`."""
    if c.get("capacity_rps") is not None:
        return f"{c['capacity_rps']:.2f} req/s"
    if c.get("at_least_rps") is not None:
        return f"at least {c['at_least_rps']:.2f} req/s"
    return "over the bound at its lowest rate"


def capacity(runs: list[dict[str, Any]], bound: float, key: str = "norm_latency_mean") -> dict:
    """Per mode: `crossing` of its runs (mean normalized latency by default)."""
    modes = dict.fromkeys(r["mode"] for r in runs)
    return {m: crossing([r for r in runs if r["mode"] == m], bound, key) for m in modes}


def _ratio(cap: dict, a: str, b: str) -> float | None:
    """Capacity of a over b, only where both sweeps crossed the bound."""
    x, y = cap.get(a), cap.get(b)
    if not x or not y or not (x["crossed"] and y["crossed"]):
        return None
    if not x["capacity_rps"] or not y["capacity_rps"]:
        return None
    return x["capacity_rps"] / y["capacity_rps"]


def claims(runs: list[dict[str, Any]], bound: float) -> dict[str, Any]:
    """The paper's comparison per think time: each mode's capacity where its mean normalized
    latency reaches `bound` (p90 as a second, stricter figure), and their ratios."""
    out = {}
    for think in sorted({r["think_s"] for r in runs}):
        these = [r for r in runs if r["think_s"] == think]
        mean, p90 = capacity(these, bound), capacity(these, bound, "norm_latency_p90")
        peak: dict[str, float] = {}
        for r in these:
            if r["metrics"]["turns"]:
                peak[r["mode"]] = max(peak.get(r["mode"], 0.0), r["metrics"]["throughput_rps"])
        ps, pg = _ratio(mean, "pensieve", "stateless"), _ratio(mean, "pensieve", "gpu")
        out[f"think_{think:g}s"] = {
            "latency_bound_s_per_token": bound,
            "peak_rps": peak,  # the most each mode served at any rate, whatever its latency
            # None where the sweep never crossed the bound: see `at_least_rps` then.
            "capacity_rps": {m: c["capacity_rps"] for m, c in mean.items()},
            "at_least_rps": {m: c["at_least_rps"] for m, c in mean.items() if not c["crossed"]},
            "crossed": {m: c["crossed"] for m, c in mean.items()},
            "capacity": mean,
            "capacity_p90": p90,
            # None where either sweep did not cross the bound: no ratio of capacities then.
            "pensieve_over_stateless": ps,
            "pensieve_over_gpu": pg,
            "pensieve_over_stateless_p90": _ratio(p90, "pensieve", "stateless"),
            "pensieve_over_gpu_p90": _ratio(p90, "pensieve", "gpu"),
            "pensieve_2x_stateless": None if ps is None else ps >= 2.0,
            "pensieve_beats_gpu": None if pg is None else pg > 1.0,
        }
    return out


def merge_runs(earlier: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier runs, less those that a new run of the same mode, think time and rate replaces."""
    key = lambda r: (r["mode"], r["think_s"], r["rate"])  # noqa: E731
    replaced = {key(r) for r in new}
    return [r for r in earlier if key(r) not in replaced] + new


def run_record(mode: str, think: float, rate: float, records, wall: float, extra: dict) -> dict:
    return {
        "mode": mode,
        "think_s": think,
        "rate": rate,
        "wall_s": wall,
        "metrics": metrics(records, wall),
        **extra,
    }


def run_line(r: dict[str, Any]) -> str:
    m = r["metrics"]
    return (
        f"{r['mode']:<18} think {r['think_s']:>5g}s rate {r['rate']:>5g}/s  "
        f"{m['throughput_rps']:6.2f} req/s {m['throughput_tps']:7.1f} tok/s  "
        f"norm lat mean {m['norm_latency_mean'] * 1e3:7.1f} p90 {m['norm_latency_p90'] * 1e3:7.1f} ms/tok  "
        f"ttft p50 {m['ttft_p50_s']:.2f}s p90 {m['ttft_p90_s']:.2f}s  "
        f"cached {m['cached_tokens']} swapped {m['swapped_in_tokens']} "
        + (f"disk {m['disk_tokens']} " if m.get("disk_tokens") else "")
        + f"recomputed {m['recomputed_tokens']} susp {m['suspensions']} err {m['errors']}"
    )
