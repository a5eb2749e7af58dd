"""The GPU report's plumbing: every part as a dry run on the CPU (dummy:tiny; the decode part's
MoE point on dummy:tiny-moe), and its JSON."""

from __future__ import annotations

import json

import pytest

from bench import gpu_report
from bench.lib import gpu_settings
from bench.lib.pools import BENCH_QUEUE
from bench.parts import serving


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dry_run_of_every_part_writes_one_report(tmp_path) -> None:
    out = tmp_path / "gpu-report-cpu.json"
    argv = ["--device", "cpu", "--model", "dummy:tiny", "--out", str(out)]
    assert gpu_report.main([*argv, "--part", "mfu,decode"]) == 0
    assert gpu_report.main([*argv, "--part", "serve,extra"]) == 0  # merged into the same file
    r = json.loads(out.read_text())
    parts = ("mfu", "decode", "serve", "extra")  # steady: tests/bench/test_bare_gpu.py
    assert set(parts) <= set(r) and r["benchmark"] == "gpu_report"
    assert r["environment"]["git_commit"] and r["settings"]["model"] == "dummy:tiny"
    assert all(r[p]["git_commit"] for p in parts)

    assert [x["prompt_tokens"] for x in r["mfu"]["prefill"]] == [64, 128]
    assert all(x["mfu"] > 0 for x in r["mfu"]["prefill"])

    dec = r["decode"]
    assert dec["hbm"]["bytes_per_s"] > 0 and dec["weight_bytes"] > 0
    assert [(p["batch"], p["context"]) for p in dec["points"]] == [
        (1, 64),
        (4, 64),
        (1, 128),
        (4, 128),
    ]
    for p in dec["points"]:
        assert p["ratio"] == pytest.approx(p["seconds"] / p["roofline_s"])
        kv = p["batch"] * (p["context"] + 1) * dec["kv_bytes_per_token"]  # steps // 2 = 1
        assert p["roofline_s"] == pytest.approx(
            (dec["weight_bytes"] + kv) / dec["hbm"]["bytes_per_s"]
        )
    moe = dec["moe"]  # dummy:tiny-moe: 8 experts, 2 a token, in 3 of 4 layers
    assert moe["model"] == "dummy:tiny-moe" and moe["experts_path"] == "loop"
    assert [(p["batch"], p["context"]) for p in moe["points"]] == [(1, 64), (4, 64)]
    expert = 3 * 256 * 128 * 4  # one expert's bytes (float32)
    one, four = moe["points"]
    assert one["experts_touched"] == pytest.approx(2) and 2 < four["experts_touched"] < 8
    extra = 3 * (four["experts_touched"] - 2) * expert  # experts past the top 2, 3 layers
    assert four["weight_bytes"] - one["weight_bytes"] == pytest.approx(extra, abs=4)
    assert one["weight_bytes"] < moe["all_weight_bytes"] - 3 * 6 * expert + 4
    for p in moe["points"]:
        kv = p["batch"] * (p["context"] + 1) * moe["kv_bytes_per_token"]
        want = (p["weight_bytes"] + kv) / dec["hbm"]["bytes_per_s"]
        assert p["roofline_s"] == pytest.approx(want) and p["seconds"] > 0

    sv = r["serve"]
    assert {x["mode"] for x in sv["runs"]} == {"stateless", "gpu", "pensieve"}
    for x in sv["runs"]:
        m = x["metrics"]
        assert m["errors"] == 0 and m["turns"] > 0 and x["scale"] == 30.0
        assert x["think_replayed_s"] == pytest.approx(2.0)
        assert x["max_waiting"] == BENCH_QUEUE  # what its twin replays
        table = x["turns"]  # every turn, for a turn-by-turn comparison with the twin
        rows = [dict(zip(table["columns"], row, strict=True)) for row in table["rows"]]
        assert sum(r["cut"] for r in rows) == m["cancelled_at_drain"]
        assert sum(1 for r in rows if not r["cut"] and not r["error"]) == m["turns"]
    assert set(sv["capacity"]) == set(sv["capacity_p90"]) == {"stateless", "gpu", "pensieve"}
    for c in sv["capacity"].values():
        assert {"crossed", "under_rate", "over_rate", "capacity_rps", "at_least_rps"} <= set(c)
    # Pensieve keeps the context of returning turns; stateless recomputes it.
    kept = [x["metrics"] for x in sv["runs"] if x["mode"] == "pensieve"]
    assert sum(m["cached_tokens"] + m["swapped_in_tokens"] for m in kept) > 0
    assert all(x["metrics"]["cached_tokens"] == 0 for x in sv["runs"] if x["mode"] == "stateless")

    ex = r["extra"]
    modes = {x["mode"] for x in ex["runs"]}
    assert {"pensieve", "pensieve-lru", "pensieve-sampled", "pensieve-unscaled", "oracle"} <= modes
    sampled = next(x for x in ex["runs"] if x["mode"] == "pensieve-sampled")
    assert sampled["temperature"] == 1.0 and sampled["metrics"]["errors"] == 0
    assert set(ex["sampled_vs_greedy"]) == {"norm_latency_mean", "throughput_tps"}
    unscaled = next(x for x in ex["runs"] if x["mode"] == "pensieve-unscaled")
    assert unscaled["scale"] == 1.0 and unscaled["think_replayed_s"] == 60.0
    assert set(ex["scaled_vs_unscaled"]) == {
        "norm_latency_mean",
        "norm_latency_p90",
        "throughput_rps",
    }
    assert "lru_recomputed" in ex["eviction"] and "oracle" in ex["capacity"]
    oracle = next(x for x in ex["runs"] if x["mode"] == "oracle")
    assert oracle["cpu_cache_chunks"] >= ex["history_chunks"]  # never drops
    assert "MFU" in r["table"] and set(r["claims"]) >= {"pensieve_over_stateless"}
    assert out.with_name(out.stem + "-serve.png").stat().st_size > 5_000
    assert out.with_name(out.stem + "-decode.png").stat().st_size > 5_000


def test_the_oracle_holds_what_arrives_in_its_window_not_the_whole_sample() -> None:
    from dataclasses import replace

    from bench.lib.pools import history_chunks

    s = gpu_settings.Settings(device="cpu")
    convs, _ = gpu_settings.load_sample(s)
    whole = int(history_chunks(convs) * 1.1) + 64
    low, high = (gpu_settings.oracle_chunks(s, convs, r) for r in (4.0, 16.0))
    assert 64 < low < high < whole  # at 16/s, 720 of 1,600 conversations arrive in 45 s
    assert gpu_settings.oracle_chunks(replace(s, window_s=1e6), convs, 4.0) == whole
    assert gpu_settings.no_room(s, whole, whole) is None  # checked on a GPU machine only


def test_a_serving_engine_is_warmed_up_and_left_empty() -> None:
    """`warm_up`: every prompt length decoded before any window, nothing kept after it."""
    import asyncio

    from engine import AsyncEngine, EngineConfig

    async def main() -> tuple[int, int, int, int]:
        engine = AsyncEngine(EngineConfig(model="dummy:tiny", device="cpu", gpu_cache_chunks=256))
        await engine.start()
        try:
            await serving.warm_up(engine)
            e = engine.engine
            counters = e.snapshot().counters
            return counters.prompt_tokens, e.context_limit // 2, len(e.streams), len(e.cache.held())
        finally:
            await engine.stop()

    prompt_tokens, longest, streams, held = asyncio.run(main())
    assert prompt_tokens == sum(min(n, longest) for n in serving.WARM_PROMPTS)
    assert streams == held == 0
