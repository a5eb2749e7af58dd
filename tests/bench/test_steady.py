"""The steady state (`bench/lib/steady.py`): a simulated warm-up cut and written, an engine
seeded from it, the replay resumed; the GPU report's steady part rehearsed and twinned in
virtual time (`bench/sim_steady.py`). Its real dry run on the bare GPU machine is in
tests/bench/test_bare_gpu.py."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from bench import sim, sim_serve, sim_steady
from bench.lib import steady as st
from bench.lib.gpu_settings import STEADY_MODES, dry_settings, load_sample


@pytest.fixture(scope="module")
def dry():
    s = dry_settings("dummy:tiny")
    convs, _ = load_sample(s)
    return s, convs


def test_residency_is_run_length_encoded_and_the_sample_repeats_without_sharing(dry):
    tiers = ["dropped"] * 3 + ["disk", "cpu", "cpu", "both", "gpu", "gpu"]
    assert st.encode(tiers) == "d3k1c2b1g2" and st.decode("d3k1c2b1g2") == tiers
    assert st.encode([]) == "" and st.decode("") == []
    _, convs = dry
    # The sample cycled: every copy its own id and first token (no prefix shared), else the same
    repeated = [st.nth(convs, k) for k in range(3 * len(convs) + 2)]
    assert repeated[: len(convs)] == convs
    assert len({c.id for c in repeated}) == len(repeated)
    assert len({c.turns[0].prompt[0] for c in repeated[:: len(convs)]}) == 4
    copy = repeated[len(convs)]
    assert copy.turns[0].prompt[1:] == convs[0].turns[0].prompt[1:]
    assert copy.turns[1:] == convs[0].turns[1:]
    c = convs[0]
    assert st.history(c, 2) == c.turns[0].prompt + [0] * c.turns[0].output_len + (
        c.turns[1].prompt + [0] * c.turns[1].output_len
    )


@pytest.fixture(scope="module")
def big(dry):
    """The dry run's short conversations on the 13B-GQA10 shape (simulated: no weights)
    with tiers of 16 and 64 chunks: steps long enough that turns are in flight at a cut."""
    s, convs = dry
    return replace(s, model="dummy:llama-2-13b-gqa10", steady_gpu_gb=0.1, steady_cpu_gb=0.4), convs


@pytest.fixture(scope="module")
def warm(big, tmp_path_factory):
    """A pensieve warm-up on tiny tiers, cut at 20 virtual seconds."""
    s, convs = big
    state = sim_steady.warm_up(s, "pensieve", 8.0, "h100", convs, log=lambda *a: None)
    path = state.write(tmp_path_factory.mktemp("steady") / "pensieve-8.json")
    return state, path


def test_the_cut_writes_every_live_conversation_and_what_holds_chunks(big, warm):
    s, convs = big
    state, path = warm
    again = st.State.read(path)
    assert json.loads(path.read_text())["columns"] == st.COLUMNS
    assert [r.to_list() for r in again.rows] == [r.to_list() for r in state.rows]
    assert again.next_index == state.next_index and again.cut_s >= s.steady_cut_s
    assert state.summary["live"] > 10 and state.summary["in_flight_partial"] > 0
    flying = [r.next_s == 0 for r in state.rows]  # those in flight come first
    assert state.summary["in_flight"] == sum(flying) == flying.index(False)
    assert {"gpu", "cpu", "dropped"} <= set(state.summary["chunks"])  # tiers full: evicted
    rank = st.RANK
    for r in state.rows:
        tiers = st.decode(r.residency)
        assert len(tiers) == -(-r.kv // 32) and r.index < state.next_index
        assert all(rank[a] <= rank[b] for a, b in zip(tiers, tiers[1:], strict=False))
        assert r.idle_s >= 0 and (r.next_s is None or r.next_s >= 0)
        conv = st.nth(convs, r.index)
        if r.partial:  # in flight: its history as far as it had computed it
            assert r.next_s == 0 and 0 < r.kv <= len(r.tokens(conv))
            spec = r.next_turn(conv)
            assert spec.prompt and spec.output_len > 0
            assert len(r.tokens(conv)) + len(spec.prompt) + spec.output_len == len(
                st.history(conv, r.turns + 1)
            )
        elif r.turns:  # a turn's end leaves its last sampled token uncomputed
            assert r.kv == len(st.history(conv, r.turns)) - 1
    held = sum(t in ("gpu", "both") for r in state.rows for t in st.decode(r.residency))
    assert 0 < held <= state.gpu_cache_chunks
    assert state.warmup_metrics["turns"] > 0


def test_a_seeded_engine_holds_the_state_and_the_replay_resumes_it(big, warm):
    from bench.lib.gpu_settings import simulated_engine, steady_preset

    s, convs = big
    state, _ = warm
    engine = simulated_engine(steady_preset(s, "pensieve"), "pensieve", "h100")
    seeds, bad = st.seeds(state, convs, "t", engine.now())
    assert not bad and len(seeds) == sum(1 for r in state.rows if r.tokens(st.nth(convs, r.index)))
    engine.seed(seeds)
    engine.cache.check()
    snap = {c.id: c for c in engine.snapshot().conversations}
    for r in state.rows:
        if r.kv:
            c = snap[f"t/{st.nth(convs, r.index).id}"]
            want = [t.replace("both", "gpu") for t in st.decode(r.residency)]
            assert list(c.chunks) == want and c.idle_s == pytest.approx(r.idle_s, abs=1e-6)
    plans = st.resume(state, convs, stop_s=5.0)
    live = {r.index: r for r in state.live()}
    resumed = [p for p in plans if p.start or p.context]
    assert len(resumed) == sum(1 for r in live.values() if r.tokens(st.nth(convs, r.index)))
    for p in resumed:
        k = next(k for k, r in live.items() if st.nth(convs, k).id == p.conversation.id)
        r = live[k]
        assert p.start == r.turns and p.arrival_s == pytest.approx(r.next_s)
        assert p.context == len(r.tokens(st.nth(convs, k)))
        assert p.conversation.turns[p.start] == r.next_turn(st.nth(convs, k))
    flying = [p.conversation.id for p in plans if p.arrival_s == 0]  # in the engine's order
    assert flying == [st.nth(convs, r.index).id for r in state.rows if r.next_s == 0][: len(flying)]
    new = [p for p in plans if p.conversation.id not in {st.nth(convs, k).id for k in live}]
    assert new and new[0].conversation == st.nth(convs, state.next_index)
    assert all(0 < p.arrival_s <= 5.0 for p in new)
    engine.close()


def test_the_steady_part_is_rehearsed_from_its_states_with_its_budget(dry):
    s, _ = dry
    out = sim_serve.rehearse("steady", s, "h100")
    assert [m for m in dict.fromkeys(r["mode"] for r in out["runs"])] == list(STEADY_MODES)
    assert not out["skipped"] and out["fits"]
    for r in out["runs"]:
        assert r["seeded"] > 0 and r["metrics"]["turns"] > 0
        table = r["turns"]  # every turn sent, warm-up and drain too, for a turn-by-turn twin
        assert len(table["rows"]) > r["metrics"]["turns"]
        assert all(len(row) == len(table["columns"]) for row in table["rows"])
        assert r["estimated_wall_s"] <= r["seed_s"] + s.steady_warmup_s + s.steady_window_s + (
            s.steady_drain_s
        )
        first = r["metrics"]["first_second"]
        if r["mode"] == "stateless":
            assert first["cached_tokens"] == 0
        if r["mode"] == "pensieve":
            assert first["cached_tokens"] + first["swapped_in_tokens"] > 0
    assert out["estimated_s"] == pytest.approx(out["runs"][-1]["ends_at_s"])
    tight = sim_serve.rehearse("steady", replace(s, steady_budget_s=10.0), "h100")
    assert not tight["runs"] and len(tight["skipped"]) == 2 * len(STEADY_MODES)


def test_a_reports_steady_runs_are_simulated_from_the_same_states(dry, tmp_path):
    from dataclasses import asdict

    s, convs = dry
    folder = tmp_path / "states"
    sim_steady.make_states(s, "h100", ["pensieve"], folder, convs, log=lambda *a: None)
    settings = {**asdict(s), "steady_states": str(folder)}
    real = {"mode": "pensieve", "rate": 2.0, "state": "pensieve-2.json",
            "metrics": {"throughput_rps": 5.0, "norm_latency_mean": 0.05, "turns": 10,
                        "errors": 0}}  # fmt: skip
    report = {"settings": settings, "steady": {"runs": [real]}}
    path = tmp_path / "gpu-report-x.json"
    path.write_text(json.dumps(report))
    assert sim.main(["--gpu-report", str(path), "--gpu-steady", "--device", "h100"]) == 0
    out = json.loads((tmp_path / "gpu-report-x-steady-sim-h100.json").read_text())
    (p,) = out["points"]
    (r,) = out["runs"]
    assert r["seeded"] > 0 and p["throughput_rps"]["sim"] == r["metrics"]["throughput_rps"]


def test_the_committed_states_are_those_the_part_runs() -> None:
    """Each rate of `Settings.steady_rates` has its state in `steady_states`, made for the
    part's tiers, think time and sample by a warm-up of at least `steady_cut_s`."""
    from bench.lib.gpu_settings import Settings, state_mismatch, steady_preset
    from bench.sim_steady import steady_folder

    s = Settings(device="cpu")
    folder = steady_folder(s, [])
    assert set(s.steady_rates) | set(s.steady_skipped) == set(STEADY_MODES)
    for mode, rates in s.steady_rates.items():
        assert len(rates) == 2 and rates[0] < rates[1]
        for rate in rates:
            state = st.State.read(st.state_path(folder, mode, rate))
            assert (state.mode, state.rate, state.think_s) == (mode, rate, s.steady_think_s)
            assert state.cut_s >= s.steady_cut_s and state.sample == s.sample
            assert state.sample_size == s.conversations and state.simulated.startswith(
                "SIMULATED h100"
            )
            assert state_mismatch(state, steady_preset(s, mode)) is None
            assert state.summary["live"] > 300 and len(state.rows) >= state.summary["live"]
