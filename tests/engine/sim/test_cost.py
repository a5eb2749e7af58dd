"""The simulator's cost models: the roofline's regimes, the fitted model's fit, Cost(l)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from engine.calibrate import _nonnegative_fit
from engine.model.loader import model_args
from engine.sim.cost import Features, Fitted, Roofline, Shape, Work, chunk_costs
from engine.sim.devices import DEVICES, RESULTS, gpu_device

GQA = Shape.of(model_args("dummy:llama-2-13b-gqa10"), "bfloat16")


def test_features_count_causal_pairs_and_kv_reads() -> None:
    f = Features.of([Work(3, 10, True), Work(1, 100, True), Work(4, 0, False)])
    assert (f.tokens, f.sampled, f.pieces) == (8, 2, 3)
    # 3 queries over 10 earlier keys + the causal triangle 1+2+3; 1 over 100 (+1); 1+2+3+4
    assert f.pairs == (30 + 6) + (100 + 1) + 10
    assert f.kv_tokens == 13 + 101 + 4
    assert (f.decode_kv, f.decode_padded) == (101, 101)
    # The CPU backend pads a step's decodes to the longest: 3 decodes at 10, 50 and 200.
    g = Features.of([Work(1, 9, True), Work(1, 49, True), Work(1, 199, True), Work(5, 0, True)])
    assert (g.decode_kv, g.decode_padded) == (260, 600)
    assert g.row()[4:6] == [5, 600]  # the prompt's KV apart from the decodes' padded one


def test_decode_reads_the_weights_and_a_prefill_is_compute_bound() -> None:
    h100 = gpu_device("h100", GQA).cost
    weights_s = GQA.layers * GQA.layer_params * GQA.weight_bytes / h100.spec.hbm_bps
    one = h100.forward_s([Work(1, 512, True)])
    assert weights_s < one < 3 * weights_s  # a 13B decode step: milliseconds of weight reads
    # Decoding 8 conversations costs little more than one (the weights are read once) ...
    eight = h100.forward_s([Work(1, 512, True)] * 8)
    assert eight < 1.3 * one
    # ... while a long prompt grows about linearly with its tokens.
    p1, p2 = h100.forward_s([Work(1024, 0, True)]), h100.forward_s([Work(2048, 0, True)])
    assert 1.8 < p2 / p1 < 2.3


def test_the_cost_grows_with_context_and_the_a100_is_slower() -> None:
    h100 = gpu_device("h100", GQA).cost
    a100 = gpu_device("a100-80gb", GQA).cost
    for batch in ([Work(1, 4000, True)] * 32, [Work(512, 0, True)], [Work(512, 3000, True)]):
        assert a100.forward_s(batch) > h100.forward_s(batch)
    short = h100.forward_s([Work(1, 100, True)] * 32)
    long = h100.forward_s([Work(1, 4000, True)] * 32)
    assert long > short


def test_the_h100_model_reproduces_the_measured_prefill_it_was_fitted_to() -> None:
    import json

    swap = json.loads((RESULTS / "swap-NVIDIA_H100_80GB_HBM3.json").read_text())
    got = gpu_device("h100", GQA).cost.forward_s([Work(2048, 0, True)])
    assert got == pytest.approx(swap["forward_s"], rel=0.01)


def test_the_host_time_is_apart_from_the_forward_per_sampled_row() -> None:
    h100 = gpu_device("h100", GQA).cost
    s = h100.spec
    assert s.row_host_s > 0 and s.step_host_s >= 0
    decode = [Work(1, 1000, True)] * 80
    assert h100.host_s(decode) == pytest.approx(s.step_host_s + 80 * s.row_host_s)
    # A prompt's chunk that samples nothing costs no row; an empty step costs nothing
    chunk = [Work(512, 0, False)]
    assert h100.host_s(chunk + decode) == pytest.approx(h100.host_s(decode))
    assert h100.host_s([]) == 0.0 == h100.forward_s([])
    # On the devices that share the H100's host figures too, never in the forward
    for name in ("h200", "a100-80gb"):
        other = gpu_device(name, GQA).cost
        assert other.host_s(decode) == pytest.approx(h100.host_s(decode))
    no_host = replace(s, row_host_s=0.0, step_host_s=0.0)
    assert Roofline(no_host, GQA).forward_s(decode) == h100.forward_s(decode)
    # The CPU's fitted model times whole steps: no host time apart
    assert Fitted("cpu", (0.04, 0.002, 0.0, 1.6e-6, 1e-5, 1e-5, 0.0)).host_s(decode) == 0.0


def test_the_h200_model_is_traced_to_the_h200_report() -> None:
    import json

    report = json.loads((RESULTS / "gpu-report-nvidia-h200.json").read_text())
    h200, h100 = gpu_device("h200", GQA).cost, gpu_device("h100", GQA).cost
    assert h200.spec.matmul_flops == report["mfu"]["matmul_flops_per_s"]
    assert h200.spec.hbm_bps == report["decode"]["hbm"]["bytes_per_s"]
    # What the report does not measure is the H100's: the attention kernel, the swaps.
    assert (h200.spec.attn_bps, h200.spec.swap_in_bps) == (
        h100.spec.attn_bps,
        h100.spec.swap_in_bps,
    )
    prefill = next(p for p in report["mfu"]["prefill"] if p["prompt_tokens"] == 2048)
    got = h200.forward_s([Work(2048, 0, True)])
    assert got == pytest.approx(prefill["seconds"] / prefill["requests"], rel=0.01)
    assert h200.forward_s([Work(1, 1024, True)] * 16) < h100.forward_s([Work(1, 1024, True)] * 16)


def test_every_device_names_its_sources() -> None:
    for name in DEVICES[:-1]:
        dev = gpu_device(name, GQA)
        assert dev.sources and dev.label.startswith(name)
        for src in dev.sources:
            assert "spec sheet" in src or (RESULTS / src).exists(), src
    with pytest.raises(ValueError, match="unknown simulated device"):
        gpu_device("tpu", GQA)


def test_nonnegative_fit_recovers_weights_and_drops_a_negative_one() -> None:
    rng = random.Random(0)
    true = [0.01, 0.002, 0.0, 3e-7, 0.0, 2e-6, 0.0005]
    rows, times = [], []
    for _ in range(60):
        f = Features.of([Work(rng.choice([1, 64, 300]), rng.randrange(0, 900), True)
                         for _ in range(rng.randrange(1, 9))])  # fmt: skip
        rows.append(f.row())
        times.append(
            sum(w * x for w, x in zip(true, f.row(), strict=True)) * rng.uniform(0.99, 1.01)
        )
    got = _nonnegative_fit(rows, times)
    assert all(w >= 0 for w in got)
    pred = [sum(w * x for w, x in zip(got, r, strict=True)) for r in rows]
    assert max(abs(p - t) / t for p, t in zip(pred, times, strict=True)) < 0.05


def test_chunk_costs_are_positive_and_monotone_in_context() -> None:
    for cost in (
        gpu_device("h100", GQA).cost,
        Fitted("cpu", (0.04, 0.002, 0.0, 1.6e-6, 1e-5, 1e-5, 0.0)),
    ):
        model = chunk_costs(cost, 32, 4096, 2048)
        times = [model(c) for c in model.contexts]
        assert times[0] > 0
        assert times == sorted(times)
        assert times[-1] > times[0]  # a chunk late in a long context costs more to recompute
