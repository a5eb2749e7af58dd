"""8-bit KV cache: codes plus one scale per token and KV head.

A quantized pool keeps, per layer and for K and V each, 8-bit codes
[num_blocks, block_size, kv_heads, head_dim] and float16 scales [num_blocks, block_size,
kv_heads]. `fp8` codes are e4m3 (stored as their uint8 bits: torch's CPU kernels cannot
index or index_copy float8 tensors) with scale = amax / 448; `int8` codes are
round(x / scale) with scale = amax / 127, amax over the head's `head_dim` values.

Why a scale per token and not per block: a block is filled one token at a time during
decode, so a per-block scale fixed by its first tokens clips later, larger ones, and one
that grows means requantizing the tokens already stored. A per-token scale is set once,
when the token is written, from that token alone: no read-modify-write, and a token's codes
do not depend on what shared its block or on whether it was written by a prompt step, a
decode step or a recompute. It costs 2 bytes per head_dim codes (3% at head_dim 64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_DTYPES = ("auto", "fp8", "int8")
QMAX = {"fp8": 448.0, "int8": 127.0}
CODE_DTYPE = {"fp8": torch.uint8, "int8": torch.int8}  # storage of the codes
SCALE_DTYPE = torch.float16
# Smallest scale: keeps all-zero rows finite; 2**-24 is float16's smallest subnormal.
MIN_SCALE = 2.0**-24


@dataclass(frozen=True)
class QuantizedKV:
    """One layer's K (or V) pool in 8 bits; passed to the kernels in place of a tensor."""

    codes: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    scales: torch.Tensor  # [num_blocks, block_size, kv_heads] float16
    fmt: str  # "fp8" | "int8"

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device


def quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (codes [..., head_dim] in CODE_DTYPE[fmt], scales [...] float16).

    The scale is rounded to float16 before dividing, so codes and the stored scale agree;
    the clamp absorbs the rounding."""
    qmax = QMAX[fmt]
    x = x.float()
    amax = x.abs().amax(-1)
    # Divided by a tensor on x's device, not by a Python number: CUDA torch divides by a CPU
    # scalar as a multiply by its reciprocal, which misses the correctly rounded quotient
    # (the Triton write's div_rn) by an ulp now and then, and the float16 scale with it.
    scale = (amax / amax.new_tensor(qmax)).clamp_min(MIN_SCALE).to(SCALE_DTYPE)
    y = (x / scale.float().unsqueeze(-1)).clamp(-qmax, qmax)
    if fmt == "fp8":
        codes = y.to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        codes = torch.floor(y + 0.5).to(torch.int8)  # round half up: Triton does the same
    return codes, scale


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, fmt: str, dtype: torch.dtype
) -> torch.Tensor:
    """codes [..., head_dim], scales [...] -> values [..., head_dim] in `dtype`."""
    if fmt == "fp8":
        # A 256-entry table: torch's CPU float8 -> float conversion is ~18x slower than a take.
        x = torch.take(_fp8_table(codes.device), codes.long())
    else:
        x = codes.float()  # the float32 product the Triton kernels take
    return x.mul_(scales.float().unsqueeze(-1)).to(dtype)  # in place: one pass less


_FP8_TABLES: dict[torch.device, torch.Tensor] = {}


def _fp8_table(device: torch.device) -> torch.Tensor:
    """The float32 value of every e4m3 bit pattern (the two NaN codes stay NaN)."""
    table = _FP8_TABLES.get(device)
    if table is None:
        bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        table = _FP8_TABLES[device] = bits.view(torch.float8_e4m3fn).float().to(device)
    return table
