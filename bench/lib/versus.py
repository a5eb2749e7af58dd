"""Simulated runs against real ones: the one place their error is written. A twin of a GPU
report (`bench/sim_serve.py`, `bench/sim_steady.py`) sets each run against the one it
replays (`points`, `capacities`); `compare` sets a simulated sweep against the mean of
several real `bench.serve` sweeps of the same rates, with their spread, and `table` writes
that as markdown."""

from __future__ import annotations

from typing import Any

from bench.lib.metrics import claims, crossing
from bench.lib.sweep import over

TWIN_KEYS = ("throughput_rps", "norm_latency_mean")
COMPARE_KEYS = ("throughput_rps", "norm_latency_mean", "cached_tokens", "swapped_in_tokens",
                "recomputed_tokens")  # fmt: skip


def error(sim: float | None, real: float | None) -> float | None:
    """The simulated figure's relative error against the real one (None: nothing to set
    it against)."""
    if sim is None or not real:
        return None
    return (sim - real) / real


def versus(real: float | list[float] | None, sim: float | None, spread: bool = False) -> dict:
    """A simulated figure against a real one, or against the mean of several real ones
    (a list; `spread`: their range over their mean too)."""
    if not isinstance(real, list):
        return {"real": real, "sim": sim, "error": error(sim, real)}
    mean = sum(real) / len(real) if real else None
    out: dict[str, Any] = {"real": real, "sim": sim, "error": error(sim, mean)}
    if spread:
        out["real_spread"] = (max(real) - min(real)) / mean if mean else None
    return out


def points(real: dict, sim: dict, keys=TWIN_KEYS) -> dict[str, dict]:
    """A twin's run against the real run it replays, per metric."""
    return {k: versus(real["metrics"][k], sim["metrics"][k]) for k in keys}


def capacity_of(c: dict) -> dict:
    """A mode's capacity from its `crossing`: where its latency crossed the bound, or, where
    its runs never passed it, its best throughput (`at_least`: a lower bound). Either shape
    of the crossing: a lower bound as `capacity_rps` of a run not `crossed`, or as
    `at_least_rps` beside a `capacity_rps` of None."""
    if c.get("capacity_rps") is not None:
        return {"rps": c["capacity_rps"], "at_least": not c.get("crossed", True)}
    return {"rps": c.get("at_least_rps"), "at_least": c.get("at_least_rps") is not None}


def capacities(real_runs: list[dict], sim_runs: list[dict], bound: float,
               at_least: bool = True) -> dict[str, dict]:  # fmt: skip
    """Per mode of the twin's runs, its capacity against the real one's. `at_least`: a mode
    that never crossed is set at its best throughput, marked (`capacity_of`); else only
    crossings count."""
    out = {}
    for mode in dict.fromkeys(r["mode"] for r in sim_runs):
        real = crossing([x for x in real_runs if x["mode"] == mode], bound)
        sim = crossing([x for x in sim_runs if x["mode"] == mode], bound)
        if not at_least:
            out[mode] = versus(real.get("capacity_rps"), sim.get("capacity_rps"))
            continue
        r, v = capacity_of(real), capacity_of(sim)
        out[mode] = {**versus(r["rps"], v["rps"]), "real_at_least": r["at_least"],
                     "sim_at_least": v["at_least"]}  # fmt: skip
    return out


def compare(reals: list[dict], sim: dict) -> dict:
    """Per mode and rate the real runs' mean (and their own spread) against the simulation:
    relative errors of throughput, mean normalized latency and the cache's token counts,
    and of each mode's capacity."""
    bound = sim["preset"]["latency_bound"]
    rows = []
    for s in sim["runs"]:
        same = [r for real in reals for r in real["runs"]
                if (r["mode"], r["rate"], r["think_s"]) == (s["mode"], s["rate"], s["think_s"])]  # fmt: skip
        if not same:
            continue
        row: dict[str, Any] = {"mode": s["mode"], "rate": s["rate"], "real_runs": len(same)}
        for key in COMPARE_KEYS:
            row[key] = versus([r["metrics"][key] for r in same], s["metrics"][key], spread=True)
        row["saturated"] = any(over(r, bound) for r in same)
        rows.append(row)
    caps = {}
    for think, c in claims(sim["runs"], bound).items():
        for mode, cap in c["capacity_rps"].items():
            real = [claims(r["runs"], bound).get(think, {}).get("capacity_rps", {}).get(mode)
                    for r in reals]  # fmt: skip
            caps[mode] = versus([x for x in real if x], cap)
    return {"points": rows, "capacity": caps, "speed": speed(reals, sim)}


def speed(reals: list[dict], sim: dict) -> dict:
    """The machine's speed probe during the real runs against the calibration's (a `cpu`
    model's): a ratio over 1 is a machine slower than when it was calibrated."""
    cal = sim.get("environment", {}).get("calibration", {}).get("probe_s")
    if not cal:
        return {}
    base = sum(cal) / len(cal)
    runs = [[r["mode"], r["rate"], [p / base for p in r["probe_s"]]]
            for real in reals for r in real["runs"] if r.get("probe_s")]  # fmt: skip
    ratios = [x for *_, ps in runs for x in ps]
    return {
        "calibration_probe_s": cal,
        "runs": runs,  # mode, rate, [before, after] over the calibration's
        "ratio_range": [min(ratios), max(ratios)] if ratios else None,
    }


def table(cmp: dict) -> str:
    """`compare`'s errors as markdown (bench/README.md)."""
    lines = [
        "| mode | rate | throughput | mean norm. latency | cached | swapped in | recomputed |",
        "|---|---|---|---|---|---|---|",
    ]

    def cell(v: dict) -> str:
        if v["error"] is None:
            return "-"
        return f"{v['error'] * 100:+.0f}% (real spread {v['real_spread'] * 100:.0f}%)"

    for r in cmp["points"]:
        sat = " (past bound)" if r["saturated"] else ""
        cells = " | ".join(cell(r[k]) for k in COMPARE_KEYS)
        lines.append(f"| {r['mode']} | {r['rate']:g}{sat} | {cells} |")
    lines += ["", "| mode | capacity real (runs) | simulated | error |", "|---|---|---|---|"]
    for mode, c in cmp["capacity"].items():
        real = ", ".join(f"{x:.3f}" for x in c["real"]) or "-"
        err = "-" if c["error"] is None else f"{c['error'] * 100:+.0f}%"
        sim = "-" if c["sim"] is None else f"{c['sim']:.3f}"
        lines.append(f"| {mode} | {real} | {sim} | {err} |")
    if cmp.get("speed", {}).get("ratio_range"):
        lo, hi = cmp["speed"]["ratio_range"]
        lines.append("")
        lines.append(f"The machine's speed probe in the real runs: x{lo:.2f} to x{hi:.2f} the time "
                     "it took at calibration (over 1: slower).")  # fmt: skip
    return "\n".join(lines)
