"""The serving benchmark's reporting: metrics, capacity at a latency bound, plots, and a smoke run."""

from __future__ import annotations

import json

import pytest

from bench import serve
from bench import workload as wl


def _rec(conv: str, sent: float, first: float, done: float, out: int, **stats) -> wl.TurnRecord:
    return wl.TurnRecord(conv, 0, sent, first, done, out, 10, 0, stats)


def test_metrics_of_a_run() -> None:
    recs = [
        _rec("a", 0.0, 0.5, 2.0, 10, cached_tokens=5, recomputed_tokens=3),
        _rec("b", 1.0, 1.2, 5.0, 20, swapped_in_tokens=7, suspensions=1),
        wl.TurnRecord("c", 0, 1.0, 1.0, 1.0, 0, 10, 0, error="ValueError: too long"),
    ]
    m = serve.metrics(recs, wall_s=6.0)
    assert m["turns"] == 2 and m["errors"] == 1 and m["error_samples"] == ["ValueError: too long"]
    assert m["duration_s"] == pytest.approx(5.0)
    assert m["throughput_rps"] == pytest.approx(0.4)
    assert m["throughput_tps"] == pytest.approx(6.0)
    assert m["norm_latency_mean"] == pytest.approx((0.2 + 0.2) / 2)
    assert m["ttft_p50_s"] == pytest.approx(0.35)
    assert (m["cached_tokens"], m["swapped_in_tokens"], m["recomputed_tokens"]) == (5, 7, 3)
    assert m["suspensions"] == 1


def _run(mode: str, rate: float, rps: float, p90: float, think: float = 60.0) -> dict:
    m = {"turns": 10, "errors": 0, "throughput_rps": rps, "norm_latency_p90": p90}
    return {"mode": mode, "rate": rate, "think_s": think, "metrics": m}


def test_capacity_and_claims_at_the_bound() -> None:
    runs = [
        _run("stateless", 1, 0.9, 0.1),
        _run("stateless", 2, 1.0, 0.9),  # past the bound: does not count
        _run("gpu", 1, 0.9, 0.1),
        _run("gpu", 2, 1.5, 0.3),
        _run("pensieve", 1, 0.9, 0.1),
        _run("pensieve", 2, 1.8, 0.2),
        _run("pensieve", 4, 2.5, 0.5),
    ]
    cap = serve.capacity(runs, bound=0.5)
    assert cap == {"stateless": 0.9, "gpu": 1.5, "pensieve": 2.5}
    c = serve.claims(runs, bound=0.5)["think_60s"]
    assert c["pensieve_over_stateless"] == pytest.approx(2.5 / 0.9)
    assert c["pensieve_2x_stateless"] and c["pensieve_beats_gpu"]
    c = serve.claims(runs, bound=0.15)["think_60s"]
    assert c["pensieve_over_stateless"] == pytest.approx(1.0) and not c["pensieve_2x_stateless"]


def test_plot_serve_writes_a_png(tmp_path) -> None:
    from bench.plots import plot_serve

    runs = [{**_run(m, r, r, 0.05 * r, t), "metrics": {
        "turns": 1, "errors": 0, "throughput_rps": r, "norm_latency_p90": 0.05 * r,
        "norm_latency_mean": 0.03 * r}} for m in ("pensieve", "stateless") for r in (1, 2)
        for t in (60.0, 600.0)]  # fmt: skip
    path = plot_serve({"runs": runs, "preset": {"latency_bound": 0.1}}, tmp_path / "f.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


@pytest.mark.timeout(300)
def test_serve_smoke_on_the_real_engine(tmp_path) -> None:
    pytest.importorskip("engine.engine")
    out = tmp_path / "serve.json"
    assert serve.main(["--preset", "tiny", "--out", str(out), "--no-plot"]) == 0
    result = json.loads(out.read_text())
    assert {r["mode"] for r in result["runs"]} == {"pensieve", "stateless"}
    summary = result["workload"]["summary"]
    planned = round(summary["output_tokens_per_turn"]["mean"] * summary["turns"])
    for r in result["runs"]:
        m = r["metrics"]
        assert m["errors"] == 0 and m["turns"] == summary["turns"]
        assert m["output_tokens"] == planned  # ignore_eos: every reply has its reference length
    by_mode = {r["mode"]: r["metrics"] for r in result["runs"]}
    # Later turns reuse the kept context in pensieve mode; stateless recomputes it all.
    assert by_mode["pensieve"]["cached_tokens"] + by_mode["pensieve"]["swapped_in_tokens"] > 0
    assert by_mode["stateless"]["cached_tokens"] == 0
    assert result["environment"]["git_commit"]
