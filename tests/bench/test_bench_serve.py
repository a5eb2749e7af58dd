"""The serving benchmark's reporting: metrics, capacity at a latency bound, plots, and a smoke run."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from bench import serve
from bench.lib import metrics, samples, sweep
from bench.lib import workload as wl


def _rec(conv: str, sent: float, first: float, done: float, out: int, **stats) -> wl.TurnRecord:
    return wl.TurnRecord(conv, 0, sent, first, done, out, 10, 0, stats)


def test_metrics_of_a_run() -> None:
    recs = [
        _rec("a", 0.0, 0.5, 2.0, 10, cached_tokens=5, recomputed_tokens=3),
        _rec("b", 1.0, 1.2, 5.0, 20, swapped_in_tokens=7, suspensions=1),
        wl.TurnRecord("c", 0, 1.0, 1.0, 1.0, 0, 10, 0, error="ValueError: too long"),
    ]
    m = metrics.metrics(recs, wall_s=6.0)
    assert m["turns"] == 2 and m["errors"] == 1 and m["error_samples"] == ["ValueError: too long"]
    assert m["duration_s"] == pytest.approx(5.0)
    assert m["throughput_rps"] == pytest.approx(0.4)
    assert m["throughput_tps"] == pytest.approx(6.0)
    assert m["norm_latency_mean"] == pytest.approx((0.2 + 0.2) / 2)
    assert m["ttft_p50_s"] == pytest.approx(0.35)
    assert (m["cached_tokens"], m["swapped_in_tokens"], m["recomputed_tokens"]) == (5, 7, 3)
    assert m["suspensions"] == 1


def _run(mode: str, rate: float, rps: float, mean: float, think: float = 60.0, **m) -> dict:
    m = {"turns": 10, "errors": 0, "throughput_rps": rps, "norm_latency_mean": mean,
         "norm_latency_p90": 2 * mean, **m}  # fmt: skip
    return {"mode": mode, "rate": rate, "think_s": think, "metrics": m}


def test_capacity_is_interpolated_where_the_mean_crosses_the_bound() -> None:
    runs = [
        _run("pensieve", 4, 2.5, 0.6),  # out of rate order on purpose
        _run("pensieve", 1, 0.9, 0.1),
        _run("pensieve", 2, 1.8, 0.4),
    ]
    c = metrics.crossing(runs, bound=0.5)
    # Between rate 2 (1.8 req/s at 0.4) and rate 4 (2.5 req/s at 0.6): halfway in latency.
    assert c == {"crossed": True, "under_rate": 2, "over_rate": 4, "capacity_rps": 2.15,
                 "at_least_rps": None}  # fmt: skip
    # p90 (twice the mean here) crosses between rates 1 and 2: 0.2 -> 0.8 reaches 0.5 halfway.
    p90 = metrics.crossing(runs, bound=0.5, key="norm_latency_p90")
    assert p90["capacity_rps"] == pytest.approx(0.9 + 0.5 * 0.9) and p90["over_rate"] == 2


def test_capacity_of_sweeps_that_do_not_cross_or_cross_at_once() -> None:
    never = metrics.crossing([_run("gpu", 1, 0.9, 0.1), _run("gpu", 2, 1.5, 0.3)], bound=0.5)
    # Never over the bound: no capacity, only a lower bound on it.
    assert never == {"crossed": False, "under_rate": 2, "over_rate": None, "capacity_rps": None,
                     "at_least_rps": 1.5}  # fmt: skip
    assert metrics.capacity_text(never) == "at least 1.50 req/s"
    at_once = metrics.crossing([_run("gpu", 1, 0.9, 0.7), _run("gpu", 2, 1.0, 0.9)], bound=0.5)
    assert at_once["crossed"] and at_once["capacity_rps"] is None
    assert at_once["at_least_rps"] is None
    assert metrics.capacity_text(at_once) == "over the bound at its lowest rate"


def test_a_run_that_refused_turns_under_the_bound_measures_nothing() -> None:
    # Refused load might have taken it over: left out, and the sweep did not cross.
    refused = [_run("gpu", 1, 0.9, 0.1), _run("gpu", 2, 1.2, 0.2, errors=3)]
    c = metrics.crossing(refused, bound=0.5)
    assert not c["crossed"] and c["capacity_rps"] is None
    assert c["at_least_rps"] == 1.2 and c["unmeasured_rates"] == [2]
    # Over the bound although it refused turns: over all the same, and the crossing is there.
    over = [*refused, _run("gpu", 4, 1.4, 0.7, errors=9)]
    c = metrics.crossing(over, bound=0.5)
    assert c["crossed"] and (c["under_rate"], c["over_rate"]) == (1, 4)
    assert c["capacity_rps"] == pytest.approx(0.9 + (0.4 / 0.6) * 0.5)


def test_claims_compare_capacities_only_where_both_crossed() -> None:
    runs = [
        _run("stateless", 1, 0.9, 0.3),
        _run("stateless", 2, 1.1, 0.7),  # crosses at 0.9 + 0.5 * 0.2 = 1.0
        _run("gpu", 1, 0.9, 0.1),
        _run("gpu", 2, 1.5, 0.3),  # never crosses
        _run("pensieve", 1, 0.9, 0.1),
        _run("pensieve", 2, 1.8, 0.2),
        _run("pensieve", 4, 2.4, 0.8),  # crosses at 1.8 + 0.5 * 0.6 = 2.1
    ]
    c = metrics.claims(runs, bound=0.5)["think_60s"]
    assert c["capacity_rps"] == pytest.approx({"stateless": 1.0, "gpu": None, "pensieve": 2.1})
    assert c["at_least_rps"] == {"gpu": 1.5}
    assert c["crossed"] == {"stateless": True, "gpu": False, "pensieve": True}
    assert c["pensieve_over_stateless"] == pytest.approx(2.1) and c["pensieve_2x_stateless"]
    assert c["pensieve_over_gpu"] is None and c["pensieve_beats_gpu"] is None
    assert c["peak_rps"]["pensieve"] == 2.4
    # p90 (twice the mean): pensieve 0.4 -> 1.6 between rates 2 and 4; stateless over at once.
    assert c["capacity_p90"]["pensieve"]["capacity_rps"] == pytest.approx(1.8 + 0.6 / 12)
    assert c["capacity_p90"]["stateless"]["capacity_rps"] is None
    c = metrics.claims(runs, bound=0.25)["think_60s"]
    assert c["capacity"]["stateless"]["capacity_rps"] is None  # over at its lowest rate
    assert c["pensieve_over_stateless"] is None


def test_a_sweep_goes_on_past_its_rates_until_it_crosses() -> None:
    steps = sweep.rungs([0.5, 1.0], max_rate=8.0)
    assert next(steps) == 0.5 and steps.send(False) == 1.0  # the listed rates first
    assert [steps.send(False) for _ in range(3)] == [2.0, 4.0, 8.0]  # then doubling
    with pytest.raises(StopIteration):  # 16 is past max_rate
        steps.send(False)
    steps = sweep.rungs([0.5, 1.0])
    assert next(steps) == 0.5 and steps.send(False) == 1.0
    with pytest.raises(StopIteration):  # no max_rate: the listed rates only
        steps.send(False)
    steps = sweep.rungs([0.5, 1.0, 2.0], max_rate=8.0)
    assert next(steps) == 0.5
    with pytest.raises(StopIteration):  # over at the first rate: nothing lower to try
        steps.send(True)


def test_the_one_walk_stops_past_the_bound_bisects_and_ends_at_a_skip() -> None:
    import asyncio

    asked: list[float] = []

    async def measure(rate: float) -> dict | None:  # mean latency 0.1 s/token per 1/s
        asked.append(rate)
        return _run("m", rate, rate, 0.1 * rate) if rate < 100 else None

    def walk(**kw) -> list[float]:
        asked.clear()
        asyncio.run(sweep.sweep(measure, [1.0, 2.0, 4.0, 8.0], 0.5, **kw))
        return list(asked)

    assert walk() == [1.0, 2.0, 4.0, 8.0]  # 8 is past the bound: the walk stops there
    assert walk(stop_past=3.0) == [1.0, 2.0, 4.0, 8.0]  # the ladder's end
    assert walk(max_rate=64.0, stop_past=100.0) == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]
    # between 4 (under) and 8 (over): sqrt(32) is over, then between 4 and it
    assert walk(refine=2) == [1.0, 2.0, 4.0, 8.0, pytest.approx(32**0.5),
                              pytest.approx(2 * 32**0.25)]  # fmt: skip
    assert walk(start=3) == [8.0, 4.0]  # down from an over until a pair under/over is known
    big = [50.0, 100.0, 200.0]  # 100: skipped (a budget): the walk ends, none after it
    asked.clear()
    runs = asyncio.run(sweep.sweep(measure, big, 1e9))
    assert asked == [50.0, 100.0] and [r["rate"] for r in runs] == [50.0]


def test_plot_serve_writes_a_png(tmp_path) -> None:
    from bench.lib.plots import plot_serve

    runs = [{**_run(m, r, r, 0.05 * r, t), "metrics": {
        "turns": 1, "errors": 0, "throughput_rps": r, "norm_latency_p90": 0.05 * r,
        "norm_latency_mean": 0.03 * r}} for m in ("pensieve", "stateless") for r in (1, 2)
        for t in (60.0, 600.0)]  # fmt: skip
    path = plot_serve({"runs": runs, "preset": {"latency_bound": 0.1}}, tmp_path / "f.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def _sample_file(path, n: int = 3, seed: int = 0):
    """A small tokenized sample in the format of --save-sample, without the dataset."""
    rng = random.Random(seed)
    convs = [
        wl.Conversation(
            f"c{i}",
            [
                wl.TurnSpec([rng.randrange(100, 20000) for _ in range(rng.randint(20, 90))], 6)
                for _ in range(2 + i % 2)
            ],
        )
        for i in range(n)
    ]
    samples.save_sample(path, convs, {"summary": wl.summarize(convs), "source": "synthetic"})
    return convs


def test_sample_file_round_trip(tmp_path) -> None:
    convs = _sample_file(tmp_path / "s.json")
    back, info = samples.read_sample(tmp_path / "s.json")
    assert back == convs and info["source"] == "synthetic" and info["sample_file"] == "s.json"


@pytest.mark.timeout(300)
def test_serve_smoke_on_the_real_engine(tmp_path) -> None:
    """The tiny preset end to end on the real engine (dummy:tiny), a few seconds."""
    sample = tmp_path / "sample.json"
    convs = _sample_file(sample)
    out = tmp_path / "serve.json"
    argv = ["--preset", "tiny", "--sample-file", str(sample), "--out", str(out), "--no-plot"]
    assert serve.main(argv) == 0
    result = json.loads(out.read_text())
    assert {r["mode"] for r in result["runs"]} == {"pensieve", "stateless"}
    turns = sum(len(c.turns) for c in convs)
    for r in result["runs"]:
        m = r["metrics"]
        assert m["errors"] == 0 and m["turns"] == turns
        assert m["output_tokens"] == 6 * turns  # ignore_eos: every reply has its planned length
        assert m["norm_latency_p90"] >= m["norm_latency_p50"] > 0
        assert len(r["probe_s"]) == 2 and min(r["probe_s"]) > 0  # the machine's speed: drift?
    by_mode = {r["mode"]: r["metrics"] for r in result["runs"]}
    # Later turns reuse the kept context in pensieve mode; stateless recomputes all of it.
    # Context before each turn, less the last token of each reply: it gets its KV computed
    # together with the next prompt.
    later = sum(sum(c.context_lens()[:-1]) - (len(c.turns) - 1) for c in convs)
    assert by_mode["pensieve"]["cached_tokens"] + by_mode["pensieve"]["swapped_in_tokens"] == later
    assert by_mode["pensieve"]["recomputed_tokens"] == 0
    assert by_mode["stateless"]["recomputed_tokens"] == later
    assert by_mode["stateless"]["cached_tokens"] == 0
    assert result["environment"]["git_commit"] and "claims" in result


@pytest.mark.timeout(300)
def test_typing_hints_are_an_option_of_the_serving_replay(tmp_path, monkeypatch) -> None:
    """`--typing` (typing-aware prefetch): the same schedule on a fresh engine per run of
    `--order`, the engine told of each user typing in the runs that are on."""
    from engine import AsyncEngine

    told: list[str] = []
    prefetch = AsyncEngine.prefetch

    def hint(self, conversation_id: str) -> None:
        told.append(conversation_id)
        prefetch(self, conversation_id)

    monkeypatch.setattr(AsyncEngine, "prefetch", hint)
    sample = tmp_path / "sample.json"
    convs = _sample_file(sample, n=3)
    out = tmp_path / "prefetch.json"
    argv = ["--preset", "tiny", "--sample-file", str(sample), "--out", str(out), "--no-plot",
            "--typing", "0.2,0.3", "--typing-think", "0.4,0.5", "--rates", "4",
            "--order", "off,on"]  # fmt: skip
    assert serve.main(argv) == 0
    result = json.loads(out.read_text())
    assert [r["typing"] for r in result["runs"]] == [False, True]
    assert result["preset"]["typing_lead_s"] == [0.2, 0.3] and result["preset"]["rate"] == 4
    later = sum(len(c.turns) - 1 for c in convs)
    # told before each later turn, in the run with hints only (its conversations' ids)
    assert len(told) == later and all(t.startswith("typing/") for t in told)
    for r in result["runs"]:
        assert r["metrics"]["errors"] == 0 and r["returning"]["turns"] == later
        assert r["first"]["turns"] == len(convs)
    plain, typing = result["summary"]["plain"], result["summary"]["typing"]
    assert plain["ttft_mean_s"] > 0 and typing["ttft_mean_s"] > 0
    assert "ttft_mean_change" in result["summary"]
    assert result["environment"]["git_commit"]


def test_merge_runs_replaces_the_same_point() -> None:
    earlier = [_run("pensieve", 1, 0.9, 0.1), _run("stateless", 1, 0.5, 0.3)]
    new = [_run("stateless", 1, 0.6, 0.2), _run("stateless", 2, 0.7, 0.4)]
    merged = metrics.merge_runs(earlier, new)
    assert [(r["mode"], r["rate"]) for r in merged] == [
        ("pensieve", 1),
        ("stateless", 1),
        ("stateless", 2),
    ]
    assert merged[1]["metrics"]["throughput_rps"] == 0.6  # the new run of the same point wins


@pytest.mark.timeout(300)
def test_append_builds_one_sweep_from_several_invocations(tmp_path) -> None:
    """A sweep split across commands (as under a per-command time limit) ends up in one file."""
    sample = tmp_path / "sample.json"
    _sample_file(sample, n=2)
    out = tmp_path / "serve.json"
    base = ["--preset", "tiny", "--sample-file", str(sample), "--out", str(out), "--no-plot"]
    assert serve.main([*base, "--modes", "pensieve"]) == 0
    assert serve.main([*base, "--modes", "stateless", "--append"]) == 0
    result = json.loads(out.read_text())
    assert [r["mode"] for r in result["runs"]] == ["pensieve", "stateless"]
    assert result["modes"] == ["pensieve", "stateless"]
    assert set(result["claims"]["think_0.5s"]["peak_rps"]) == {"pensieve", "stateless"}
    assert all(r["git_commit"] for r in result["runs"])
    assert serve.main([*base, "--modes", "stateless", "--conversations", "1"]) == 0
    result = json.loads(out.read_text())  # without --append: a new file
    assert [r["mode"] for r in result["runs"]] == ["stateless"]
    assert result["workload"]["summary"]["conversations"] == 1  # the first of the sample
    assert result["runs"][0]["metrics"]["turns"] == 2


@pytest.mark.timeout(300)
def test_a_disk_tier_mode_runs_and_counts_its_reads(tmp_path) -> None:
    """`pensieve-disk`: the same engine with a disk tier (a fresh directory) behind its CPU
    tier, emptied between runs so that no run finds another's chunks."""
    sample = tmp_path / "sample.json"
    _sample_file(sample, n=2)
    out = tmp_path / "serve.json"
    args = ["--preset", "tiny", "--sample-file", str(sample), "--out", str(out), "--no-plot"]
    assert serve.main([*args, "--modes", "pensieve-disk"]) == 0
    result = json.loads(out.read_text())
    assert [r["mode"] for r in result["runs"]] == ["pensieve-disk"]
    assert "disk_tokens" in result["runs"][0]["counters"]


def test_fit_pools_keeps_tiers_given_in_chunks() -> None:
    # The CPU preset sizes both tiers from its sample's history; `--cpu-chunks 192` (a small
    # second tier, say in front of a disk tier) must stay 192, not be refitted to it all.
    from bench.lib.pools import fit_pools, history_chunks
    from bench.lib.presets import PRESETS

    convs = [wl.Conversation(f"c{i}", [wl.TurnSpec([1] * 300, 16)] * 3) for i in range(8)]
    total = history_chunks(convs)
    fitted = fit_pools(PRESETS["cpu"], convs)
    assert fitted.cpu_cache_chunks == total and fitted.gpu_cache_chunks < total
    small = fit_pools(replace(PRESETS["cpu"], cpu_cache_chunks=5), convs)
    assert small.cpu_cache_chunks == 5 and small.gpu_cache_chunks == fitted.gpu_cache_chunks


def test_the_oracle_keeps_the_gpu_tier_and_never_drops() -> None:
    from bench.lib.pools import for_mode, history_chunks
    from bench.lib.presets import MODES, PRESETS

    preset = replace(PRESETS["cpu"], gpu_cache_chunks=100, cpu_cache_chunks=200)
    convs = [wl.Conversation(id="a", turns=[wl.TurnSpec(list(range(3000)), 2000)] * 3)]
    every = history_chunks(convs)
    assert every > 200
    oracle = for_mode(preset, MODES["oracle"], convs)
    # The same GPU tier (the same batches on the same card), a second tier that holds all.
    assert oracle.gpu_cache_chunks == 100 and oracle.cpu_cache_chunks >= every
    both = for_mode(preset, MODES["oracle-gpu"], convs)
    assert both.gpu_cache_chunks >= every and both.cpu_cache_chunks >= every
    assert for_mode(preset, MODES["pensieve"], convs) == preset
