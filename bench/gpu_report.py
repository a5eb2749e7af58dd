"""The GPU report: prefill MFU, the decode roofline and serving capacity, in one command.

    python -m bench.gpu_report                        # every part, about 31 min on an H100
    python -m bench.gpu_report --part mfu,decode      # about 5 min
    python -m bench.gpu_report --part serve           # about 7.5 min: the capacity sweep
    python -m bench.gpu_report --part extra           # at most 9 min: unscaled check, oracle, lru
    python -m bench.gpu_report --part steady          # at most 8 min: the steady state, unscaled
    python -m bench.gpu_report --device cpu --model dummy:tiny   # dry run of every part

Everything runs in this process on the engine (no server, no web stack), on dummy weights
of the 13B-GQA10 shape, replaying the committed ShareGPT sample: a bare GPU machine without
network needs only the tree. Parts run separately merge into one
`bench/results/gpu-report-<device>.json`; each stops starting runs that would not finish
within its budget (`--budget`) and records what it skipped. The parts: mfu, decode and
profile (`bench/parts/device.py`); serve, extra and steady (`bench/parts/serving.py`), each
a list of runs of the one replay (`bench/lib/replay.py`) whose twin on a simulated device
is `python -m bench.sim --gpu-report` (`bench/sim_serve.py`, `bench/sim_steady.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.lib.common import RESULTS, device_slug, environment
from bench.lib.gpu_settings import STEADY_MODES, Settings, dry_settings
from bench.lib.metrics import capacity_text
from bench.parts.device import decode_line, part_decode, part_mfu, part_profile, profile_line
from bench.parts.serving import part_extra, part_serve, part_steady

# Each part: (settings, its deadline on time.monotonic(), the report so far) -> its result
PARTS = {"mfu": part_mfu, "decode": part_decode, "profile": part_profile,
         "serve": part_serve, "extra": part_extra, "steady": part_steady}  # fmt: skip


def _log(*a) -> None:
    print(*a, flush=True)


# ---------------------------------------------------------------- the report


def summary(report: dict[str, Any]) -> str:
    """The table printed at the end (and kept in the JSON)."""
    lines = [
        f"GPU report: {report['environment']['device']} at {report['environment']['git_commit']}"
    ]
    mfu = report.get("mfu")
    if mfu:
        for r in mfu["prefill"]:
            lines.append(
                f"  prefill {r['prompt_tokens']:>6} tokens   MFU {r['mfu']:.2f}   (goal 0.5)"
            )
    dec = report.get("decode")
    if dec:
        lines.append(f"  HBM copy {dec['hbm']['bytes_per_s'] / 1e9:.0f} GB/s")
        lines += ["  " + decode_line(r) for r in dec["points"]]
        lines += ["  moe " + decode_line(r) for r in dec.get("moe", {}).get("points", [])]
    prof = report.get("profile")
    if prof:
        lines += ["  " + profile_line(m, r) for m, r in prof["modes"].items()]
        for key, r in prof["scattered_rates"].items():
            lines.append(f"  profile scattered {key:<10} {r['GBps']:.2f} GB/s")
        lines += [f"  profile skipped: {x}" for x in prof["skipped"]]
    for part in ("serve", "extra", "steady"):
        res = report.get(part)
        if not res:
            continue
        for m, c in res["capacity"].items():
            p90 = res["capacity_p90"][m]
            bound = report["settings"]["bound"] * 1e3
            lines.append(
                f"  {part} {m:<18} capacity {capacity_text(c)} at {bound:g} ms/token mean, "
                f"p90 {capacity_text(p90)}"
                + (
                    f" (refusing runs left out at {c['unmeasured_rates']}/s)"
                    if c.get("unmeasured_rates")
                    else ""
                )
            )
        for line in res.get("skipped", []):
            lines.append(f"  {part} skipped: {line}")
    c = report.get("claims", {})
    for key, val in c.items():
        lines.append(f"  {key}: {_fmt(val) if isinstance(val, float) else val}")
    return "\n".join(lines)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def claims(report: dict[str, Any]) -> dict[str, Any]:
    cap = report.get("serve", {}).get("capacity", {})
    extra = report.get("extra", {})
    val = lambda c: c["capacity_rps"] if c and c["crossed"] else None  # noqa: E731
    p, st, g = (val(cap.get(m)) for m in ("pensieve", "stateless", "gpu"))
    o = val(extra.get("capacity", {}).get("oracle"))
    steady = report.get("steady", {}).get("capacity", {})
    sst, sg, sp, so = (val(steady.get(m)) for m in STEADY_MODES)
    return {
        "pensieve_over_stateless": p / st if p and st else None,
        "pensieve_over_gpu": p / g if p and g else None,
        "pensieve_over_oracle": p / o if p and o else None,
        "lru_recomputes_more_by": (extra.get("eviction") or {}).get("fewer_recomputed"),
        "sampled_over_greedy_tps": (
            (extra.get("sampled_vs_greedy") or {}).get("throughput_tps", {}).get("ratio")
        ),
        # The steady part (the paper's setting, unscaled): capacities where both crossed
        "steady_pensieve_over_stateless": sp / sst if sp and sst else None,
        "steady_pensieve_over_gpu": sp / sg if sp and sg else None,
        "steady_pensieve_over_oracle": sp / so if sp and so else None,
    }


def plot(report: dict[str, Any], path: Path) -> list[Path]:
    """Decode step vs roofline per point, and the serving curves of both serving parts."""
    from bench.lib.plots import plot_bars, plot_serve

    out = []
    dec = report.get("decode")
    if dec and any("seconds" in r for r in dec["points"]):
        rows = []
        for r in dec["points"]:
            if "seconds" in r:
                rows.append({"name": f"b{r['batch']} c{r['context']}", "x": r["ratio"]})
        for r in dec.get("moe", {}).get("points", []):
            if "seconds" in r:
                rows.append({"name": f"moe b{r['batch']} c{r['context']}", "x": r["ratio"]})
        title = f"decode step / roofline ({report['environment']['device']})"
        out.append(
            plot_bars(
                rows,
                "x",
                "step time / roofline",
                title,
                path.with_name(path.stem + "-decode.png"),
                "%.2f",
            )
        )
    runs = report.get("serve", {}).get("runs", []) + [
        x for x in report.get("extra", {}).get("runs", []) if x["mode"] != "pensieve"
    ]
    if runs:
        # One think time column: the scaled replay (the unscaled run is drawn with it).
        flat = [{**x, "think_s": report["settings"]["think_s"]} for x in runs]
        res = {
            "runs": flat,
            "preset": {"latency_bound": report["settings"]["bound"], "model": report["settings"]["model"],
                       "conversations": report["settings"]["conversations"],
                       "note": f"think time / {report['settings']['scale']:g}, tiers / {report['settings']['scale']:g}"},
            "environment": report["environment"],
        }  # fmt: skip
        out.append(plot_serve(res, path.with_name(path.stem + "-serve.png")))
    steady = report.get("steady", {}).get("runs", [])
    if steady:
        s = report["settings"]
        res = {
            "runs": steady,
            "preset": {"latency_bound": s["bound"], "model": s["model"],
                       "note": f"steady state, think time {s['steady_think_s']:g} s, tiers "
                               f"{s['steady_gpu_gb']:g} + {s['steady_cpu_gb']:g} GiB, unscaled"},
            "environment": report["environment"],
        }  # fmt: skip
        out.append(plot_serve(res, path.with_name(path.stem + "-steady.png")))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.gpu_report", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--part", default=",".join(PARTS), help=f"comma-separated, of {tuple(PARTS)}")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", help="default: dummy:llama-2-13b-gqa10 (dummy:tiny on the CPU)")
    ap.add_argument("--budget", type=float, help="seconds per part")
    ap.add_argument("--rates", help="comma-separated ladder of new conversations per second")
    ap.add_argument("--start-rate", type=float, help="where the first mode's sweep starts")
    ap.add_argument("--scale", type=float, help="k: think time / k and tiers / k")
    ap.add_argument("--window", type=float, help="seconds each serving run sends turns")
    ap.add_argument("--out", type=Path, help="default bench/results/gpu-report-<device>.json")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    parts = [p for p in args.part.split(",") if p]
    if bad := [p for p in parts if p not in PARTS]:
        ap.error(f"unknown parts {bad}; choose from {tuple(PARTS)}")
    if args.device == "cpu":
        s = dry_settings(args.model or "dummy:tiny")
    else:
        s = Settings(device=args.device, model=args.model or Settings.model)
    for key, val in (("budget_s", args.budget), ("start_rate", args.start_rate),
                     ("scale", args.scale), ("window_s", args.window)):  # fmt: skip
        if val is not None:
            s = replace(s, **{key: val})
    if args.rates:
        s = replace(s, rates=[float(x) for x in args.rates.split(",")])

    import torch

    if s.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: use --device cpu for the dry run")
    env = environment(s.device)
    out = args.out or RESULTS / f"gpu-report-{device_slug(env['device'])}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    if report.get("settings", {}).get("model") not in (None, s.model):
        ap.error(f"{out} holds a report of another model; pass --out")
    for part in parts:
        t0 = time.monotonic()
        # The steady part's own budget (engine starts included) unless --budget says
        part_budget = s.steady_budget_s if part == "steady" and args.budget is None else s.budget_s
        if part == "profile":  # short whatever the others get
            part_budget = min(part_budget, s.profile_budget_s)
        budget = t0 + part_budget
        _log(f"== {part} (budget {part_budget:.0f} s)")
        res = PARTS[part](s, budget, report)
        res = asyncio.run(res) if asyncio.iscoroutine(res) else res
        res["elapsed_s"] = time.monotonic() - t0
        res["git_commit"] = env["git_commit"]
        report[part] = res
        report.setdefault("parts_environment", {})[part] = env
        report.update(benchmark="gpu_report", environment=env, settings=asdict(s))
        report["claims"] = claims(report)
        out.write_text(json.dumps(report, indent=1, default=float) + "\n")  # each part kept at once
    report["table"] = summary(report)
    out.write_text(json.dumps(report, indent=1, default=float) + "\n")
    print(report["table"])
    print(f"wrote {out}")
    if not args.no_plot:
        try:
            for p in plot(report, out.with_suffix(".png")):
                print(f"wrote {p}")
        except ImportError as e:  # a bare GPU machine: plot later where matplotlib is
            print(f"no plot ({e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
