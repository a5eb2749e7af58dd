"""The system scenario of bench.cluster (replicas, one killed), end to end at a small size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_small_cluster_load_loses_nothing_when_a_replica_dies(tmp_path):
    """bench.cluster end to end at a small size: two replicas behind HAProxy, one killed
    mid-run and restarted; every turn is answered and stored in the right chat."""
    cmd = [sys.executable, "-m", "bench.cluster", "--replicas", "2", "--chats", "4",
           "--turns", "2", "--max-tokens", "4", "--think", "1", "--model", "dummy:tiny",
           "--out", "cluster_test", "--out-dir", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=360)
    out = tmp_path / "cluster_test.json"
    assert out.exists(), proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["check"]["ok"], r["check"]
    assert r["turns_answered"] == 4 * 2
    assert proc.returncode == 0
