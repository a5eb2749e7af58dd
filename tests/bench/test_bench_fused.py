"""The fused-kernel benchmark's dry run: both paths run and the JSON holds their points."""

from __future__ import annotations

import json

from bench import fused
from tests.kernels.test_kernels import needs_triton_cpu


@needs_triton_cpu
def test_dry_run_times_both_paths(tmp_path) -> None:
    assert fused.main(["--dry-run", "--out", str(tmp_path), "--iters", "1"]) == 0
    result = json.loads((tmp_path / "fused-cpu-dry-run.json").read_text())
    methods = {(p["tokens"], p["method"]) for p in result["points"]}
    assert methods == {(t, m) for t in (1, 5) for m in ("unfused", "fused")}
    assert [r["tokens"] for r in result["summary"]] == [1, 5]
    assert all(p["ms"] > 0 and p["gbps"] > 0 for p in result["points"])
