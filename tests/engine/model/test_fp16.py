"""float16 linear weights with float32 math (engine/model/fp16.py, `weights="float16"`): each
linear is float32 math over its weight rounded to float16, and the engine gives the greedy
tokens of transformers whose linear weights are rounded the same way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import Engine, EngineConfig, SamplingParams, Turn
from engine.model import fp16
from engine.model.fp16 import Fp16Linear
from engine.model.loader import BUNDLED
from tests.oracle import hf_greedy, hf_model

pytestmark = pytest.mark.skipif(not fp16.available(), reason="no FBGEMM float16 linear here")

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and say why they are prime.",
)


@pytest.mark.parametrize("rows", [1, 8, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_fp16_linear_is_float32_math_over_float16_weights(rows, bias):
    g = torch.Generator().manual_seed(rows)
    lin = nn.Linear(576, 1536, bias=bias)
    nn.init.normal_(lin.weight, std=0.05, generator=g)
    x = torch.randn(2, rows, 576, generator=g)
    want = F.linear(x, lin.weight.half().float(), lin.bias)
    got = Fp16Linear(lin)(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and not the float32 weight's product: the rounding is the weights' alone
    assert (got - lin(x)).abs().max() > 1e-6


def test_the_compiler_takes_the_fp16_linear_as_one_opaque_op():
    lin = Fp16Linear(nn.Linear(64, 32))
    compiled = torch.compile(lin, dynamic=False, fullgraph=True)  # a graph break fails
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(compiled(x), lin(x), rtol=0, atol=0)


def hf_with_fp16_linears(engine: Engine):
    """transformers on the same checkpoint, each linear's weight rounded to float16 (the tied
    output projection untied first: the embedding stays float32, as in the engine)."""
    model = hf_model(engine)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.weight = nn.Parameter(m.weight.detach().half().float(), requires_grad=False)
    return model


def test_float16_weights_give_transformers_greedy_tokens_on_float16_weights():
    # A pool for the 3 turns (3 chunks each), not one sized from memory (5 s to allocate)
    engine = Engine(
        EngineConfig(
            model=BUNDLED, device="cpu", weights="float16", gpu_cache_chunks=16, cpu_cache_chunks=0
        )
    )
    try:
        linears = [m for m in engine.model.modules() if isinstance(m, nn.Linear | Fp16Linear)]
        assert linears and all(isinstance(m, Fp16Linear) for m in linears)
        assert next(engine.model.parameters()).dtype == torch.float32
        tok = engine.tokenizer
        prompts = [
            tok.encode(
                tok.apply_chat_template(
                    [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
                ),
                add_special_tokens=False,
            )
            for q in PROMPTS
        ]
        sp = SamplingParams(max_tokens=24, ignore_eos=True)
        got = [
            r.token_ids for r in engine.run([Turn(f"c{i}", p, sp) for i, p in enumerate(prompts)])
        ]
        model = hf_with_fp16_linears(engine)
        want = [hf_greedy(model, p, 24, set()) for p in prompts]
        assert got == want
    finally:
        engine.close()


def test_float16_weights_are_refused_where_they_cannot_run():
    with pytest.raises(ValueError, match="weights='float16' computes in float32"):
        EngineConfig(weights="float16", dtype="bfloat16").validate()
    with pytest.raises(ValueError, match="weights='float16'.*tensor parallel"):
        EngineConfig(weights="float16", tensor_parallel=2).validate()


def test_serve_picks_float16_weights_where_the_cpu_serves_float32(caplog):
    """Where the server picks float32 (no native bfloat16), it picks float16 linears with
    it and says so; a given --weights or --dtype is kept."""
    from app.cli import _settings, _with_serving_dtype, parser

    def served(*flags):
        return _with_serving_dtype(
            _settings(parser().parse_args(["serve", "--device", "cpu", *flags]))
        )

    with caplog.at_level("INFO"):
        picked = served()
    if picked.dtype == "float32":
        assert picked.weights == "float16" and picked.engine_config().weights == "float16"
        assert "weights float16: " in caplog.text
    else:
        assert picked.weights == "auto"
    assert served("--weights", "float32").weights == "float32"
    kept = served("--dtype", "float32")
    assert (kept.dtype, kept.weights) == ("float32", "auto")
    assert served("--weights", "float16").dtype == "float32"
