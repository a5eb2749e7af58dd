"""CPU only: linears with float16 weights and float32 arithmetic (FBGEMM's fp16 GEMM).

On an x86 CPU without native bfloat16 (AVX2, no AVX512-BF16 or AMX) the model runs in
float32, and a decode step's few-row matmuls are bound by reading the weights: FBGEMM
keeps them packed in float16 (half the bytes) and widens them to float32 in registers
(F16C), so the activations and every sum stay float32. Only the weights round, to
float16's 11 bits (the bundled GGUF's 4-bit blocks dequantize to values float16 holds to
within 2^-11, where bfloat16 keeps 8 bits).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from engine.model.packed import OpaqueLinear, swap_cpu_linears

log = logging.getLogger(__name__)


class Fp16Linear(OpaqueLinear):
    """y = x W^T (+ b) in float32, W held in FBGEMM's packed float16 layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear.in_features, linear.out_features)
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach().float(), bias)

    def apply_to(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.quantized.linear_dynamic_fp16(x.reshape(-1, self.in_features), self.packed)
        return y.reshape(*lead, self.out_features)

    def weight_bytes(self) -> int:
        return 2 * self.in_features * self.out_features


@functools.cache
def available() -> bool:
    """FBGEMM is built in and its fp16 linear agrees with float32 math on float16 weights."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        lin = nn.Linear(64, 48)
        nn.init.normal_(lin.weight, generator=gen)
        x = torch.randn(5, 64, generator=gen)
        want = nn.functional.linear(x, lin.weight.half().float(), lin.bias)
        return torch.allclose(Fp16Linear(lin)(x), want, rtol=1e-5, atol=1e-5)
    except (RuntimeError, AttributeError) as e:  # an op missing from this build
        log.info("no float16 CPU linears: %s", e)
        return False


def swap_fp16(model: nn.Module) -> int:
    """Each float32 CPU nn.Linear of `model` becomes an Fp16Linear; returns how many."""
    return swap_cpu_linears(model, lambda dtype: dtype == torch.float32, Fp16Linear)
