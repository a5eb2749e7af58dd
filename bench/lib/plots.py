"""Figures of the benchmarks: latency vs throughput curves per mode, and throughput bars."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {
    "pensieve": ("tab:red", "o"),
    "pensieve-lru": ("tab:orange", "v"),
    "pensieve-returns": ("tab:cyan", "X"),
    "pensieve-separate": ("tab:purple", "s"),
    "gpu": ("tab:blue", "^"),
    "stateless": ("tab:gray", "D"),
    "server": ("tab:green", "o"),
    "oracle": ("black", "*"),
    "oracle-gpu": ("gray", "*"),
    "pensieve-disk": ("tab:brown", "P"),
}


TIERS = (
    ("GPU", "gpu_cache_gb"),
    ("CPU", "cpu_cache_gb"),
    ("disk (pensieve-disk)", "disk_cache_gb"),
)


def save_fig(fig, path: Path, dpi: int = 110) -> Path:
    """Lay out, write and close a figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_serve(result: dict[str, Any], path: Path) -> Path:
    """Normalized latency (mean and p90) vs throughput, one line per mode, one column per think time."""
    runs = result["runs"]
    thinks = sorted({r["think_s"] for r in runs})
    fig, axes = plt.subplots(
        2, len(thinks), figsize=(max(7.5, 5.5 * len(thinks)), 7), squeeze=False, sharex="col"
    )
    bound = result.get("preset", {}).get("latency_bound")

    def claims(think: float) -> dict:
        return result.get("claims", {}).get(f"think_{think:g}s", {})

    def cap_label(think: float, mode: str) -> str:
        """The mode and its capacity: at the bound, or the most it served never reaching it."""
        c = claims(think)
        cap = c.get("capacity_rps", {}).get(mode)
        if cap:
            return f"{mode}: {cap:.2f} req/s at the bound"
        least = c.get("at_least_rps", {}).get(mode)
        return f"{mode}: at least {least:.2f} req/s (never over it)" if least else mode

    for col, think in enumerate(thinks):
        for row, (key, label) in enumerate(
            (("norm_latency_mean", "mean"), ("norm_latency_p90", "p90"))
        ):
            ax = axes[row][col]
            for mode in dict.fromkeys(r["mode"] for r in runs):
                # One point per request rate, joined in rate order.
                pts = [
                    (r["metrics"]["throughput_rps"], r["metrics"][key])
                    for r in sorted(runs, key=lambda r: r["rate"])
                    if r["mode"] == mode and r["think_s"] == think and r["metrics"]["turns"]
                ]
                if not pts:
                    continue
                color, marker = STYLE.get(mode, (None, "o"))
                xs, ys = zip(*pts, strict=True)
                name = cap_label(think, mode) if key == "norm_latency_mean" else mode
                ax.plot(xs, [y * 1e3 for y in ys], marker=marker, color=color, label=name)
            if bound:
                ax.axhline(bound * 1e3, ls="--", lw=1, color="black", label="bound")
            ax.set_yscale("log")
            ax.set_ylabel(f"{label} normalized latency (ms/token)")
            ax.grid(True, which="both", alpha=0.3)
            if row == 0:
                ax.set_title(f"think time {think:g} s")
            else:
                ax.set_xlabel("throughput (requests/s)")
            ax.legend(fontsize=8)
    preset = result.get("preset", {})
    env = result.get("environment", {})
    lines = [
        f"{preset.get('model', '')} on {env.get('device', '?')}",
        f"{preset.get('conversations', '?')} ShareGPT conversations; {preset.get('note', '')}",
    ]
    run = []  # a simulated run: its window and its tiers (a real host may cap the CPU tier)
    if preset.get("arrival_s"):
        run.append(f"steady state of {preset['arrival_s'] / 60:g} min of arrivals")
    gib = [(n, preset[k]) for n, k in TIERS if preset.get(k)]
    if result.get("simulated") and gib:
        run.append("tiers " + ", ".join(f"{n} {v:g} GiB" for n, v in gib))
    if run:
        lines.append("; ".join(run))
    fig.suptitle("\n".join(lines), fontsize=8)
    return save_fig(fig, path)


def plot_bars(
    rows: list[dict[str, Any]], key: str, ylabel: str, title: str, path: Path, fmt: str = "%.1f"
) -> Path:
    """One bar per row (row["name"], row[key]), labelled with its value."""
    fig, ax = plt.subplots(figsize=(1.3 * len(rows) + 2, 4))
    names = [r["name"] for r in rows]
    vals = [r[key] for r in rows]
    colors = [STYLE.get(n.split(" ")[0], ("tab:green", ""))[0] for n in names]
    bars = ax.bar(names, vals, color=colors)
    ax.bar_label(bars, fmt=fmt, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    return save_fig(fig, path)


def plot_prefetch(result: dict[str, Any], path: Path) -> Path:
    """Typing-aware prefetch (`bench.serve --typing`): TTFT of returning turns and
    throughput, with typing hints and without."""
    s = result["summary"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    keys = [("ttft_mean_s", "mean"), ("ttft_p50_s", "median"), ("ttft_p90_s", "p90")]
    xs = range(len(keys))
    lead = "-".join(f"{x:g}" for x in result["preset"]["typing_lead_s"])
    for off, kind, color in ((-0.2, "plain", "tab:gray"), (0.2, "typing", "tab:red")):
        label = "no typing hints" if kind == "plain" else f"typing {lead} s before"
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
