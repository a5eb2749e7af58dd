"""The first command on a lent GPU: every `-m gpu` test, the swap bench, then the report's
short parts (mfu, decode, profile).

    python -m bench.gpu_check            # make gpu-check: at most ~9 min on an H100
    python -m bench.gpu_check --dry-run  # the same sequence on the CPU with dummy:tiny

Needs only what a bare GPU machine has (torch, triton, transformers, pytest, numpy; no web
stack, no data packages). Writes bench/results/gpu-check-<device>.json (the tests' outcome,
with the device and commit), swap-<device>.json (bench.swap) and, through bench.gpu_report,
gpu-report-<device>.json with the `mfu`, `decode` and `profile` parts; `make gpu-report` adds `serve` and `extra` to the same file.
A dry run writes under the temp dir unless --out-dir is given. Exits non-zero when a test
fails or a part breaks, and at once when there is no CUDA device (without --dry-run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from bench.lib.common import RESULTS, ROOT, device_slug, environment

TOTAL_S = 540.0  # the whole command, on an H100 from a bare machine
TESTS_S = 300.0  # the GPU tests' share; the report's parts get what is left
SWAP_S = 120.0  # bench.swap (about a minute on an H100: loads the 13B shape, then copies)
PARTS = ("mfu", "decode", "profile")  # the report's short parts (profile: at most a minute)


def _log(*a) -> None:
    print(*a, flush=True)


def run_tests(junit: Path, timeout: float, env: dict[str, str]) -> dict[str, Any]:
    """`pytest -m gpu`, its outcome read back from the JUnit XML it writes."""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    cmd += ["-o", "addopts=-ra", f"--junitxml={junit}"]
    _log("$ " + " ".join(cmd[2:]))
    t0 = time.monotonic()
    try:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = None
    out: dict[str, Any] = {"returncode": rc, "elapsed_s": time.monotonic() - t0}
    if rc is None:
        out["error"] = f"timed out after {timeout:.0f} s"
    if junit.exists():
        out.update(read_junit(junit))
    return out


def read_junit(path: Path) -> dict[str, Any]:
    """Counts and the failing tests of a pytest JUnit XML report."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, slowest = [], []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        slowest.append((float(case.get("time") or 0), name))
        outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            counts["passed"] += 1
        elif outcome.tag == "skipped":
            counts["skipped"] += 1
        else:
            counts["failed" if outcome.tag == "failure" else "errors"] += 1
            message = (outcome.get("message") or "").splitlines()[:1]
            failures.append({"test": name, "message": message[0] if message else ""})
    slowest.sort(reverse=True)
    return {
        **counts,
        "failures": failures,
        "slowest": [{"test": n, "seconds": t} for t, n in slowest[:10]],
    }


def run_module(args: list[str], timeout: float, env: dict[str, str]) -> int | None:
    """`python -m <args>` in the checkout: its exit code, None if it ran past `timeout`."""
    cmd = [sys.executable, "-m", *args]
    _log("$ " + " ".join(args))
    try:
        return subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return None


def run_swap(out: Path, timeout: float, env: dict[str, str], dry: bool) -> int | None:
    """bench.swap: chunk swaps contiguous and scattered, through the block-copy kernel and
    run by run (what the serving runs' swaps cost)."""
    args = ["bench.swap", "--out", str(out)]
    if dry:
        args += ["--model", "dummy:tiny", "--device", "cpu", "--chunks", "16", "--repeats", "2"]
    return run_module(args, timeout, env)


def run_report(parts: str, extra: list[str], timeout: float, env: dict[str, str]) -> int | None:
    return run_module(["bench.gpu_report", "--part", parts, *extra], timeout, env)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.gpu_check", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--dry-run", action="store_true", help="on the CPU with dummy:tiny")
    ap.add_argument("--out-dir", type=Path, help="default bench/results (dry run: the temp dir)")
    ap.add_argument("--total", type=float, default=TOTAL_S, help="seconds for the whole check")
    args = ap.parse_args(argv)

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print(
            "gpu-check: no CUDA device here (torch sees none); nothing was run. "
            "On the CPU, `python -m bench.gpu_check --dry-run` rehearses the sequence.",
            file=sys.stderr,
        )
        return 2
    t0 = time.monotonic()
    deadline = t0 + args.total
    dry_dir = Path(tempfile.gettempdir()) / "pensieve-dry-run"
    out_dir = args.out_dir or (dry_dir if args.dry_run else RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    device = "cpu" if args.dry_run else "cuda"
    info = environment(device)
    slug = device_slug(info["device"])

    with tempfile.TemporaryDirectory() as tmp:
        tests = run_tests(Path(tmp) / "junit.xml", min(TESTS_S, args.total / 2), env)
    swap = out_dir / f"swap-{slug}.json"
    t_swap = time.monotonic()
    swap_rc = run_swap(swap, SWAP_S, env, args.dry_run)
    swap_s = time.monotonic() - t_swap
    report = out_dir / f"gpu-report-{slug}.json"
    extra = ["--out", str(report), "--no-plot"]
    if args.dry_run:
        extra += ["--device", "cpu", "--model", "dummy:tiny"]
    left = deadline - time.monotonic()
    # Each part's budget is half of what is left, less the time to build the model.
    extra += ["--budget", f"{max(30.0, left / 2 - 30):.0f}"]
    t_parts = time.monotonic()
    parts_rc = run_report(",".join(PARTS), extra, max(60.0, left), env)

    result = {
        "benchmark": "gpu_check",
        "environment": info,
        "dry_run": args.dry_run,
        "tests": tests,
        "report": {
            "parts": list(PARTS),
            "file": report.name,
            "returncode": parts_rc,
            "elapsed_s": time.monotonic() - t_parts,
        },
        "swap": {"file": swap.name, "returncode": swap_rc, "elapsed_s": swap_s},
        "elapsed_s": time.monotonic() - t0,
    }
    out = out_dir / f"gpu-check-{slug}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    ok = tests.get("returncode") in (0, 5) and not tests.get("failures") and parts_rc == 0
    ok = ok and swap_rc == 0
    _log(summary(result))
    _log(f"wrote {out}")
    return 0 if ok else 1


def summary(result: dict[str, Any]) -> str:
    t, r = result["tests"], result["report"]
    lines = [
        f"gpu-check on {result['environment']['device']} at "
        f"{result['environment']['git_commit']} ({result['elapsed_s']:.0f} s)",
        f"  tests: {t.get('passed', 0)} passed, {t.get('failed', 0)} failed, "
        f"{t.get('errors', 0)} errors, {t.get('skipped', 0)} skipped "
        f"in {t['elapsed_s']:.0f} s" + (f" ({t['error']})" if "error" in t else ""),
    ]
    lines += [f"  FAILED {f['test']}: {f['message']}" for f in t.get("failures", [])]
    state = "ok" if r["returncode"] == 0 else f"exit {r['returncode']}"
    parts = ",".join(r["parts"])
    lines.append(f"  report parts {parts}: {state} in {r['elapsed_s']:.0f} s -> {r['file']}")
    w = result["swap"]
    state = "ok" if w["returncode"] == 0 else f"exit {w['returncode']}"
    lines.append(f"  swap bench: {state} in {w['elapsed_s']:.0f} s -> {w['file']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
