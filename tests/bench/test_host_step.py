"""The host-step benchmark, run tiny: its load is what it says, its figures add up."""

from __future__ import annotations

import json

import pytest

from bench import host_step


@pytest.mark.timeout(300)
def test_host_step_runs_tiny_and_its_figures_add_up(tmp_path) -> None:
    out = tmp_path / "host-step.json"
    argv = ["--conversations", "24", "--context", "90", "--decodes", "4", "--prompt", "9"]
    argv += ["--steps", "12", "--warmup", "10", "--gpu-cache-chunks", "64"]
    argv += ["--cpu-cache-chunks", "256", "--out", str(out)]
    assert host_step.main(argv) == 0
    r = json.loads(out.read_text())
    # Ramped up: every measured step holds the decodes and one new prompt (and the token
    # its conversation's last turn left uncomputed).
    assert r["per_step"] == {"decodes": 4, "prompt_tokens": 10}
    assert r["held"] == 24
    assert len(r["steps_ms"]) == 12
    h = r["host_ms"]
    assert 0 < min(r["steps_ms"]) <= h["median"] <= h["p90"] <= max(r["steps_ms"])
    assert h["mean"] == pytest.approx(sum(r["steps_ms"]) / 12, rel=1e-2)
    assert 0 < r["host_cpu_ms"]["median"] <= r["host_cpu_ms"]["p90"]
    phases = r["phases_ms"]
    assert set(phases) == set(host_step.PHASES)
    # every phase took time, and the phases' means make up the step's
    assert all(p["mean"] > 0 for p in phases.values())
    assert sum(p["mean"] for p in phases.values()) == pytest.approx(h["mean"], rel=0.02, abs=0.01)
    c = r["counters"]
    assert c["generated_tokens"] > 0 and c["swapped_in_tokens"] > 0  # CPU chunks came back
    assert c["recomputed_tokens"] == 0  # every context was held in a tier
    assert 0 < r["snapshot_capture_ms"] <= r["snapshot_ms"] and r["submit_ms"] > 0
    assert r["environment"]["git_commit"] and r["device"] == "cpu"
    assert out.with_suffix(".png").stat().st_size > 5_000
