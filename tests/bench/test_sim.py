"""`python -m bench.sim`: the serving benchmark in virtual time, its scale probe and its
error table against real runs."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench import sim, sim_serve
from bench.lib import gpu_settings, versus
from engine.model.shapes import DUMMY_SHAPES


def run(tmp_path, *args: str) -> dict:
    out = tmp_path / "sim.json"
    assert sim.main(["--preset", "tiny", "--out", str(out), "--no-plot", *args]) == 0
    return json.loads(out.read_text())


def test_gemma_3_1b_at_8k_tokens_holds_only_its_window_in_sliding_layers():
    every, only = sim.held_bytes(DUMMY_SHAPES["gemma-3-1b"], 8192)
    per_token_layer = 2 * 1 * 256 * 2  # K and V, 1 KV head of 256 dims, bfloat16
    assert every == 26 * 8192 * per_token_layer
    # 22 sliding layers over 512: positions 7681..8191 lie in chunks 240..255, 16 chunks.
    assert only == (4 * 8192 + 22 * 16 * 32) * per_token_layer
    every, only = sim.held_bytes(DUMMY_SHAPES["gemma-3-1b"], 500)
    assert every == only  # inside the window: nothing saved


def test_a_tiny_sweep_is_simulated_labelled_and_deterministic(tmp_path) -> None:
    args = ("--device", "h100", "--modes", "pensieve,stateless,oracle", "--rates", "2,64")
    a, b = run(tmp_path, *args), run(tmp_path, *args)
    assert a["simulated"].startswith("SIMULATED h100 (cost model v")
    assert a["environment"]["device"] == a["simulated"]
    assert a["preset"]["device"] == "sim:h100"
    modes = {r["mode"] for r in a["runs"]}
    assert modes == {"pensieve", "stateless", "oracle"}
    for r in a["runs"]:
        m = r["metrics"]
        assert m["turns"] > 0 and m["throughput_rps"] > 0 and m["norm_latency_mean"] > 0
        assert r["host"]["steps"] > 0
    # The same seed: the same virtual results (only the host's own timings differ).
    strip = lambda res: [(r["mode"], r["rate"], r["metrics"]) for r in res["runs"]]  # noqa: E731
    assert strip(a) == strip(b)
    # Stateless recomputes every turn's history; pensieve keeps it.
    by = {(r["mode"], r["rate"]): r["metrics"] for r in a["runs"]}
    assert by[("pensieve", 2.0)]["cached_tokens"] > 0
    assert by[("stateless", 2.0)]["cached_tokens"] == 0
    assert by[("stateless", 2.0)]["recomputed_tokens"] > by[("pensieve", 2.0)]["recomputed_tokens"]


def test_append_builds_one_sweep_from_several_invocations(tmp_path) -> None:
    run(tmp_path, "--device", "h100", "--modes", "pensieve", "--rates", "2,64")
    both = run(tmp_path, "--device", "h100", "--modes", "stateless", "--rates", "2", "--append")
    assert [(r["mode"], r["rate"]) for r in both["runs"]] == [
        ("pensieve", 2.0), ("pensieve", 64.0), ("stateless", 2.0)
    ]  # fmt: skip
    assert set(both["claims"]["think_0.5s"]["capacity_rps"]) == {"pensieve", "stateless"}
    assert all(r["git_commit"] for r in both["runs"])
    with pytest.raises(SystemExit):  # other tiers: not the same sweep
        run(tmp_path, "--device", "h100", "--modes", "stateless", "--cpu-gb", "1", "--append")


def test_a_disk_tier_reads_back_what_the_small_tiers_dropped() -> None:
    from dataclasses import replace

    from bench.lib.metrics import run_line
    from bench.lib.presets import PRESETS

    # The longest conversation just fits the GPU tier; the CPU tier holds 2 chunks.
    tiny = replace(PRESETS["tiny"], gpu_cache_chunks=14, cpu_cache_chunks=2, think_s=[2.0],
                   rates=[2.0], disk_cache_gb=1.0)  # fmt: skip
    res = sim.simulate(tiny, "h100", ["pensieve", "pensieve-disk"], log=lambda *a: None)
    two, disk = res["runs"]
    assert res["workload"]["pools"]["disk_cache_gb"] == 1.0
    assert two["metrics"]["disk_tokens"] == 0 and disk["metrics"]["disk_tokens"] > 0
    assert disk["metrics"]["recomputed_tokens"] < two["metrics"]["recomputed_tokens"]
    assert disk["counters"]["spilled_tokens"] > 0
    assert disk["disk"]["writes"] > 0 and disk["disk"]["reads"] > 0 and "disk" not in two
    assert f"disk {disk['metrics']['disk_tokens']} " in run_line(disk)


def point(mode: str, rate: float, tput: float, lat: float, cached: int) -> dict:
    metrics = {"throughput_rps": tput, "norm_latency_mean": lat, "norm_latency_p90": lat,
               "cached_tokens": cached,
               "swapped_in_tokens": 0, "recomputed_tokens": 100, "turns": 10, "errors": 0}  # fmt: skip
    return {"mode": mode, "rate": rate, "think_s": 60.0, "metrics": metrics}


def test_compare_reports_errors_against_the_mean_of_the_real_runs() -> None:
    preset = {"latency_bound": 1.0}
    reals = [
        {"runs": [point("pensieve", 0.5, 0.50, 0.4, 900), point("pensieve", 1.0, 0.9, 2.0, 0)]},
        {"runs": [point("pensieve", 0.5, 0.40, 0.6, 1100), point("pensieve", 1.0, 0.8, 1.8, 0)]},
    ]
    simulated = {"preset": preset, "runs": [point("pensieve", 0.5, 0.45, 0.6, 1000),
                                            point("pensieve", 1.0, 0.85, 1.5, 0)]}  # fmt: skip
    cmp = versus.compare(reals, simulated)
    first = cmp["points"][0]
    assert first["real_runs"] == 2 and not first["saturated"]
    assert first["throughput_rps"]["error"] == pytest.approx(0.0)
    assert first["norm_latency_mean"]["error"] == pytest.approx(0.2)  # 0.6 against 0.5
    assert first["norm_latency_mean"]["real_spread"] == pytest.approx(0.4)
    assert first["cached_tokens"]["error"] == pytest.approx(0.0)
    assert first["swapped_in_tokens"]["error"] is None  # nothing to compare against
    assert cmp["points"][1]["saturated"]
    # Capacity: throughput interpolated in latency at the bound, per run.
    cap = cmp["capacity"]["pensieve"]
    assert cap["real"] == pytest.approx([0.5 + 0.4 * 0.6 / 1.6, 0.4 + 0.4 * 0.4 / 1.2])
    assert cap["sim"] == pytest.approx(0.45 + 0.4 * 0.4 / 0.9)
    assert cap["error"] == pytest.approx(cap["sim"] / (sum(cap["real"]) / 2) - 1)
    md = versus.table(cmp)
    assert "| pensieve | 0.5 | +0% (real spread 22%) | +20% (real spread 40%) |" in md
    assert "(past bound)" in md


def test_a_cpu_simulation_names_the_calibration_its_engines_made(tmp_path, monkeypatch) -> None:
    from engine import calibrate

    monkeypatch.setattr(calibrate, "PROMPTS", (32, 128))
    monkeypatch.setattr(calibrate, "BATCHES", (1, 4))
    monkeypatch.setattr(calibrate, "CONTEXTS", (64,))
    monkeypatch.setattr(calibrate, "MIXED", ((32, 4),))
    monkeypatch.setattr(calibrate, "_path", lambda config: tmp_path / "cpu.json")
    out = run(tmp_path, "--device", "cpu", "--modes", "pensieve", "--rates", "4")
    cal = out["environment"]["calibration"]
    assert cal["file"] == "cpu.json" and len(cal["probe_s"]) == 2
    # made with the preset's token budget, as its engines ran (not an engine's default)
    assert json.loads((tmp_path / "cpu.json").read_text())["max_batch_tokens"] == 256


def test_compare_tells_how_far_the_machine_drifted_from_its_calibration() -> None:
    def probed(rate: float, probe: list[float]) -> dict:
        return {**point("pensieve", rate, 0.5, 0.4, 900), "probe_s": probe}

    reals = [{"runs": [probed(0.5, [0.10, 0.12])]}, {"runs": [probed(0.5, [0.15, 0.20])]}]
    simulated = {"preset": {"latency_bound": 1.0}, "runs": [point("pensieve", 0.5, 0.5, 0.4, 900)],
                 "environment": {"calibration": {"probe_s": [0.09, 0.11]}}}  # fmt: skip
    cmp = versus.compare(reals, simulated)
    assert cmp["speed"]["ratio_range"] == pytest.approx([1.0, 2.0])
    assert cmp["speed"]["runs"][1] == ["pensieve", 0.5, pytest.approx([1.5, 2.0])]
    assert "x1.00 to x2.00" in versus.table(cmp)
    # No probe in the calibration (a GPU model, an older file): nothing is claimed
    del simulated["environment"]
    assert versus.compare(reals, simulated)["speed"] == {}


def test_a_gpu_reports_serve_runs_are_simulated_beside_it(tmp_path) -> None:
    from dataclasses import asdict

    from bench.lib.gpu_settings import dry_settings

    def real(mode: str, rate: float, tput: float, lat: float) -> dict:
        m = {"throughput_rps": tput, "norm_latency_mean": lat, "norm_latency_p90": lat,
             "turns": 10, "errors": 0}  # fmt: skip
        return {"mode": mode, "engine_mode": mode, "rate": rate, "scale": 30.0, "think_s": 60.0,
                "think_replayed_s": 2.0, "gpu_cache_chunks": 32, "cpu_cache_chunks": 160,
                "window_s": 3.5, "metrics": m}  # fmt: skip

    report = {
        "settings": asdict(dry_settings("dummy:tiny")),
        "serve": {"runs": [real("pensieve", 2.0, 0.4, 0.01), real("stateless", 2.0, 0.4, 0.02)]},
    }
    path = tmp_path / "gpu-report-x.json"
    path.write_text(json.dumps(report))
    assert sim.main(["--gpu-report", str(path), "--device", "h100"]) == 0
    out = json.loads((tmp_path / "gpu-report-x-sim-h100.json").read_text())
    assert out["simulated"].startswith("SIMULATED h100")
    assert [p["mode"] for p in out["points"]] == ["pensieve", "stateless"]
    for p, r in zip(out["points"], out["runs"], strict=True):
        assert r["metrics"]["turns"] > 0
        got = p["norm_latency_mean"]
        assert got["sim"] == r["metrics"]["norm_latency_mean"]
        assert got["error"] == pytest.approx((got["sim"] - got["real"]) / got["real"])


def test_the_gpu_serve_part_is_rehearsed_with_its_sweeps_and_budget() -> None:
    from dataclasses import replace

    from bench.lib.gpu_settings import SERVE_MODES, dry_settings
    from bench.lib.sweep import rungs

    steps = rungs([1.0, 2.0, 3.0, 4.0, 5.0], 2)  # over at 3, under at 2: done
    assert next(steps) == 3.0 and steps.send(True) == 2.0
    with pytest.raises(StopIteration):
        steps.send(False)

    s = replace(dry_settings("dummy:tiny"), budget_s=1000.0)
    out = sim_serve.rehearse("serve", s, "h100")
    assert [m for m in dict.fromkeys(r["mode"] for r in out["runs"])] == list(SERVE_MODES)
    assert out["runs"][0]["rate"] == s.start_rate and not out["skipped"]
    for r in out["runs"]:
        assert 0 < r["estimated_wall_s"] <= s.window_s + s.drain_s
    assert out["estimated_s"] == pytest.approx(out["runs"][-1]["ends_at_s"])
    # A budget that fits no run: every mode's first run is skipped.
    tight = sim_serve.rehearse("serve", replace(s, budget_s=20.0), "h100")
    assert not tight["runs"] and len(tight["skipped"]) == len(SERVE_MODES)


def test_a_capacity_is_read_from_either_shape_of_a_crossing() -> None:
    crossed = {"crossed": True, "capacity_rps": 9.5}
    assert versus.capacity_of(crossed) == {"rps": 9.5, "at_least": False}
    # Never over the bound: its best throughput, a lower bound, in either field
    assert versus.capacity_of({"crossed": False, "capacity_rps": 11.0}) == {
        "rps": 11.0,
        "at_least": True,
    }
    shape = {"crossed": False, "capacity_rps": None, "at_least_rps": 11.0}
    assert versus.capacity_of(shape) == {"rps": 11.0, "at_least": True}
    assert versus.capacity_of({"crossed": True, "capacity_rps": None})["rps"] is None


def test_the_host_time_a_real_run_implies_and_its_fit() -> None:
    real = {"wall_s": 10.0, "counters": {"steps": 400, "generated_tokens": 20000}}  # 25 ms
    twin = {"wall_s": 12.0, "counters": {"steps": 600, "generated_tokens": 24000}}  # 20 ms
    ms = sim_serve.step_ms(real, twin, (0.001, 0.0001))  # the model's host: 1 + 0.1 x 40 rows
    assert ms["rows"] == {"real": 50.0, "sim": 40.0}
    assert ms["host_model"] == pytest.approx(5.0)
    assert ms["host_implied"] == pytest.approx(25.0 - (20.0 - 5.0))
    assert (
        sim_serve.step_ms({"wall_s": 1.0, "metrics": {}}, twin, (0.0, 0.0)) is None
    )  # no counters

    def point(rows: float, ms: float) -> dict:
        return {"step_ms": {"rows": {"real": rows}, "host_implied": ms}}

    line = [point(x, 0.5 + 0.08 * x) for x in (5, 20, 33, 75, 80)]
    assert sim_serve.host_fit(line) == pytest.approx((0.5e-3, 0.08e-3))
    # A negative intercept: through the origin instead; a negative slope: a constant
    a, b = sim_serve.host_fit([point(x, -1.0 + 0.1 * x) for x in (10, 20, 80)])
    assert a == 0.0 and b > 0
    assert sim_serve.host_fit([point(10, 3.0), point(50, 1.0)]) == pytest.approx((2.0e-3, 0.0))


def test_the_devices_host_time_is_the_fit_of_the_committed_twins() -> None:
    """engine/sim/devices.py: the H100's host figures fit what the committed GPU reports'
    runs imply, as simulated with them (the H200 report's pensieve run left out: its swaps
    went block by block then)."""
    from engine.sim import devices

    h100 = devices.RESULTS / "h100-4e07f94" / "gpu-report-nvidia-h100-sim-h100-v3.json"
    h200 = devices.RESULTS / "gpu-report-nvidia-h200-sim-h200-v2.json"
    twins = [json.loads(p.read_text()) for p in (h100, h200)]
    for t in twins:  # made with the figures in force
        assert t["simulated"] == gpu_settings.label(t["simulated"].split()[1])
        assert t["step_host"]["model_ms"] == pytest.approx(
            [devices.H100_STEP_HOST_S * 1e3, devices.H100_ROW_HOST_S * 1e3]
        )
    points = twins[0]["points"] + [p for p in twins[1]["points"] if p["mode"] != "pensieve"]
    assert len(points) == 12
    a, b = sim_serve.host_fit(points)
    assert a == pytest.approx(devices.H100_STEP_HOST_S, abs=0.1e-3)
    assert b == pytest.approx(devices.H100_ROW_HOST_S, rel=0.03)


def test_a_twin_refuses_turns_at_the_queue_limit_its_report_ran_with() -> None:
    """The H100 report's stateless run at 16/s refused 178 turns at the server's 256-turn
    queue; its twin replays that limit (the benchmarks' own queue never refuses)."""
    from bench.lib.gpu_settings import load_sample
    from engine.sim import devices

    report = json.loads(
        (devices.RESULTS / "h100-4e07f94" / "gpu-report-nvidia-h100.json").read_text()
    )
    real = next(r for r in report["serve"]["runs"] if r["mode"] == "stateless" and r["rate"] == 16)
    assert "max_waiting" not in real  # made before runs recorded their queue limit
    s = gpu_settings.report_settings(report["settings"])
    convs, _ = load_sample(s)

    def refused(queue: int | None) -> int:
        run = asyncio.run(sim_serve.twin_run(s, convs, "stateless", "stateless", 16.0,
                                             real["scale"], "h100", queue=queue))  # fmt: skip
        return run["metrics"]["errors"]

    assert refused(sim_serve.REPORT_QUEUE) == pytest.approx(real["metrics"]["errors"], rel=0.15)
    assert refused(None) == 0


def test_a_twins_spread_moves_each_send_a_little_and_reads_the_median() -> None:
    from bench.lib import workload as wl

    convs = [wl.Conversation(f"c{i}", [wl.TurnSpec([1] * 10, 4)] * 3) for i in range(20)]
    plans = wl.plan(convs, 4.0, 5.0, 0)
    a, b = sim_serve.jittered(plans, 1), sim_serve.jittered(plans, 2)
    assert a == sim_serve.jittered(plans, 1) and a != b  # seeded
    for p, q in zip(plans, a, strict=True):
        assert abs(q.arrival_s - p.arrival_s) <= sim_serve.JITTER_S
        assert all(
            abs(x - y) <= sim_serve.JITTER_S for x, y in zip(p.think_s, q.think_s, strict=True)
        )
        assert q.conversation is p.conversation
    runs = [{"metrics": {"norm_latency_mean": x}} for x in (0.2, 0.1, 0.4)]
    got = sim_serve.latency_spread(runs, 0.25)
    assert got["spread"] == [0.1, 0.2, 0.4] and got["runs"] == 3
    assert got["median_error"] == pytest.approx(-0.2)
