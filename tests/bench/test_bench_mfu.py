"""The prefill MFU benchmark: its flop count against the model itself, and a smoke run."""

from __future__ import annotations

import json

import pytest

from bench import mfu
from engine.model.decoder import Decoder
from engine.model.shapes import DUMMY_SHAPES


@pytest.mark.parametrize("shape", ["tiny", "llama-2-13b-gqa10", "opt-13b"])
def test_linear_flops_are_two_per_layer_weight(shape: str) -> None:
    args = DUMMY_SHAPES[shape]
    if shape != "tiny":  # the real size stays unallocated
        import torch

        with torch.device("meta"):
            model = Decoder(args)
    else:
        model = Decoder(args)
    weights = sum(
        p.numel()
        for name, p in model.layers.named_parameters()
        if "norm" not in name and not name.endswith(".bias")
    )
    assert mfu.linear_flops_per_token(args) == 2 * weights


@pytest.mark.parametrize("shape", ["tiny-moe", "qwen3-30b-a3b"])
def test_moe_linear_flops_count_the_router_and_a_tokens_experts(shape: str) -> None:
    """Of a MoE layer's weights a token multiplies the router's and its top-k experts'."""
    import torch

    args = DUMMY_SHAPES[shape]
    with torch.device("meta"):
        model = Decoder(args)
    weights = 0
    for name, p in model.layers.named_parameters():
        if "norm" in name:
            continue
        share = args.top_k / args.n_experts if name.endswith(("moe.w13", "moe.w2")) else 1
        weights += round(p.numel() * share)
    assert mfu.linear_flops_per_token(args) == 2 * weights
    if shape == "qwen3-30b-a3b":  # 3.3B active with the embeddings, as Qwen says
        assert abs((weights + 2 * args.dim * args.vocab_size) / 1e9 - 3.35) < 0.01


def test_prefill_flops_count_every_causal_key() -> None:
    a = DUMMY_SHAPES["tiny"]
    prompt = 37
    keys = sum(p + 1 for p in range(prompt))  # position p sees keys 0..p
    attention = 4 * a.n_layers * a.n_heads * a.head_dim * keys
    head = 2 * a.dim * a.vocab_size
    assert mfu.prefill_flops(a, prompt) == prompt * mfu.linear_flops_per_token(a) + attention + head


@pytest.mark.timeout(300)
def test_mfu_smoke_on_the_cpu(tmp_path) -> None:
    out = tmp_path / "mfu.json"
    argv = ["--model", "dummy:tiny", "--device", "cpu", "--dtype", "float32"]
    argv += ["--prompts", "64,160", "--requests", "2", "--repeats", "1", "--sizes", "128,256"]
    argv += ["--batch-tokens", "128", "--out", str(out)]
    assert mfu.main(argv) == 0
    result = json.loads(out.read_text())
    assert [r["prompt_tokens"] for r in result["prefill"]] == [64, 160]
    for r in result["prefill"]:
        assert r["model_flops"] == 2 * mfu.prefill_flops(DUMMY_SHAPES["tiny"], r["prompt_tokens"])
        assert r["tokens_per_s"] == pytest.approx(2 * r["prompt_tokens"] / r["seconds"])
        assert (
            0 < r["mfu"] == pytest.approx(r["flops_per_s"] / result["matmul_flops_per_s"]["best"])
        )
    assert set(result["matmul_flops_per_s"]["by_size"]) == {"128", "256"}
    assert result["environment"]["git_commit"]
    assert out.with_suffix(".png").stat().st_size > 5_000
    png = out.with_suffix(".png")
    png.unlink()
    assert mfu.main(["--from-json", str(out)]) == 0 and png.stat().st_size > 5_000
