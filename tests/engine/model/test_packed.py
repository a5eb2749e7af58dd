"""oneDNN-packed linears on the CPU: the same maps as the model's nn.Linear layers."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from engine.model import packed
from engine.model.decoder import Decoder
from engine.model.shapes import DUMMY_SHAPES, ModelArgs

pytestmark = pytest.mark.skipif(not packed.available(), reason="no oneDNN in this torch build")

# OPT's layers carry biases on every linear (nn.Linear initializes them non-zero).
SMALL_OPT = ModelArgs(
    512,
    64,
    2,
    4,
    4,
    16,
    128,
    max_position=64,
    family="opt",
    qkv_bias=True,
    o_bias=True,
    mlp_bias=True,
)


@pytest.mark.parametrize("args", [DUMMY_SHAPES["tiny"], SMALL_OPT], ids=["llama", "opt"])
def test_every_linear_is_packed_and_computes_the_same(args: ModelArgs) -> None:
    torch.manual_seed(0)
    model = Decoder(args)
    plain = copy.deepcopy(model)
    n = packed.pack_linears(model)
    assert n == 4 * args.n_layers + 1  # wqkv, wo, w13 (or w1), w2 per layer; lm_head
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    names = [name for name, m in plain.named_modules() if isinstance(m, nn.Linear)]
    for name in names:
        ref, new = plain.get_submodule(name), model.get_submodule(name)
        assert isinstance(new, packed.PackedLinear)
        for rows in (0, 1, 3, 16, 100):  # decode batches and a prefill chunk
            x = torch.randn(rows, ref.in_features)
            torch.testing.assert_close(new(x), ref(x), rtol=1e-4, atol=1e-4)
        x = torch.randn(7, 2 * ref.in_features)[:, : ref.in_features]  # a strided view
        torch.testing.assert_close(new(x), ref(x), rtol=1e-4, atol=1e-4)


def test_float32_and_native_bfloat16_cpu_linears_are_packed() -> None:
    model = nn.Sequential(
        nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8).to(torch.float16)
    )
    ref = copy.deepcopy(model)
    bf16 = packed.available(torch.bfloat16)  # where the CPU computes bfloat16 natively
    assert packed.pack_linears(model) == 1 + bf16
    assert isinstance(model[0], packed.PackedLinear) and isinstance(model[2], nn.Linear)
    assert isinstance(model[1], packed.PackedLinear if bf16 else nn.Linear)
    x = torch.randn(2, 8)
    torch.testing.assert_close(model[0](x), ref[0](x))  # with its bias
    xb = torch.randn(5, 8).to(torch.bfloat16)
    torch.testing.assert_close(model[1](xb), ref[1](xb), rtol=2e-2, atol=2e-2)
