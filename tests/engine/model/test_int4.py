"""The bundled GGUF's own 4-bit weights (engine/model/gguf_weights.py, engine/model/int4.py):
read as stored, they dequantize to exactly the converted checkpoint; served in float32 they
give the dequantized model's greedy tokens and its logits to a stated tolerance."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from engine import Engine, EngineConfig, SamplingParams, Turn
from engine.backends.local import Local
from engine.model.families.checkpoint import iter_own
from engine.model.gguf_weights import Q4Weight, read_q4
from engine.model.int4 import Int4Linear
from engine.model.loader import BUNDLED, Checkpoint, bundled_gguf, model_args, model_dir
from tests.engine.model.test_model_families import own_logits

QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a child.",
    "List three prime numbers and say why they are prime.",
)
# float32 compute: each 4-bit linear is within float32 rounding of the dequantized one (the
# kernel adds zero = m + 8 d, not m); over 30 layers the logits move by less than this
LOGIT_TOLERANCE = 2e-3


@functools.cache
def q4() -> dict[str, Q4Weight]:
    return read_q4(bundled_gguf(), model_args(BUNDLED))


def test_q4_weights_dequantize_exactly_to_the_converted_checkpoint():
    own = dict(iter_own(model_args(BUNDLED), Checkpoint(model_dir(BUNDLED))))
    weights = q4()
    assert len(weights) == 4 * 30  # wqkv, wo, w13, w2 of every layer
    for name, w in weights.items():
        assert w.codes.max() <= 15
        assert torch.equal(w.dequantize(), own[name]), name


@pytest.mark.parametrize("part", ["wqkv", "wo", "w13", "w2"])
def test_int4_linear_equals_the_dequantized_linear(part):
    """float32: within 1e-4 (values up to ~40). bfloat16 (d and m rounded to bfloat16, the
    kernel's fast path): within 1.5% of the output's largest magnitude, as a bfloat16 copy
    of the dequantized weight is."""
    w = q4()[f"layers.3.{part}.weight"]
    dense = w.dequantize()
    g = torch.Generator().manual_seed(0)
    for rows in (0, 1, 8, 33):
        x = torch.randn(rows, dense.shape[1], generator=g)
        ref = F.linear(x, dense)
        got = Int4Linear(w, None, torch.float32)(x)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        if rows:
            half = Int4Linear(w, None, torch.bfloat16)(x.bfloat16()).float()
            assert (half - ref).abs().max() <= 1.5e-2 * ref.abs().max()


def test_gguf_weights_give_the_dequantized_models_tokens_and_logits():
    """float32 compute: the same greedy tokens for 12 decode steps on 4 chat prompts, and
    logits within LOGIT_TOLERANCE over a prompt."""
    runs = []
    for weights in ("float32", "gguf"):
        # A pool for the 4 turns (2 chunks each), not one sized from memory (5 s to allocate)
        engine = Engine(
            EngineConfig(
                model=BUNDLED, device="cpu", dtype="float32", weights=weights,
                gpu_cache_chunks=16, cpu_cache_chunks=0,
            )
        )  # fmt: skip
        swapped = sum(isinstance(m, Int4Linear) for m in engine.model.modules())
        assert swapped == (120 if weights == "gguf" else 0)
        tok = engine.tokenizer
        turns = [
            Turn(
                f"q{i}",
                tok.encode(
                    tok.apply_chat_template(
                        [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
                    ),
                    add_special_tokens=False,
                ),
                SamplingParams(max_tokens=12, ignore_eos=True),
            )
            for i, q in enumerate(QUESTIONS)
        ]
        runs.append([r.token_ids for r in engine.run(turns)])
        ids = turns[3].prompt_token_ids
        runs[-1].append(own_logits(engine.model, list(ids)))
    dense, int4 = runs
    assert dense[:4] == int4[:4]
    assert (dense[4] - int4[4]).abs().max() <= LOGIT_TOLERANCE


def test_bad_weights_are_refused_naming_the_setting():
    with pytest.raises(ValueError, match="weights must be one of"):
        EngineConfig(weights="int4").validate()
    with pytest.raises(ValueError, match="weights='float32'.*dtype"):
        EngineConfig(weights="float32", dtype="bfloat16").validate()
    with pytest.raises(ValueError, match="weights='gguf'.*tensor parallel"):
        EngineConfig(weights="gguf", tensor_parallel=2).validate()
    with pytest.raises(ValueError, match="weights='gguf'"):
        Local(EngineConfig(model="dummy:tiny", device="cpu", weights="gguf"))
    from app.settings import Settings

    with pytest.raises(ValidationError, match="weights"):
        Settings(weights="q4")


def test_the_compiler_traces_the_4bit_linear():
    """Inductor traces the int4 kernel as it is (no opaque op needed): in float32 the
    compiled linear gives eager's outputs (the compiled forward swaps these in; a whole
    compiled engine took 2 minutes of `make test` for the same fact)."""
    w = q4()["layers.3.w13.weight"]
    linear = Int4Linear(w, None, torch.float32)
    compiled = torch.compile(linear, dynamic=False, fullgraph=True)  # a graph break fails
    g = torch.Generator().manual_seed(1)
    for rows in (1, 8):
        x = torch.randn(rows, w.dequantize().shape[1], generator=g)
        torch.testing.assert_close(compiled(x), linear(x), rtol=0, atol=1e-5)


def test_serve_takes_weights_as_a_flag_and_dequantized_weights_name_the_dtype():
    from app.cli import _settings, _with_serving_dtype, parser

    args = parser().parse_args(["serve", "--device", "cpu", "--weights", "float32"])
    settings = _with_serving_dtype(_settings(args))
    assert settings.weights == "float32" and settings.dtype == "float32"
    assert settings.engine_config().weights == "float32"
