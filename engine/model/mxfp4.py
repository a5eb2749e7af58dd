"""MXFP4 (OCP microscaling, 4-bit e2m1 values in groups of 32 sharing a power-of-two scale),
as gpt-oss checkpoints hold their experts: dequantized once, when loaded.

`blocks` [..., G, 16] uint8 hold 32 codes a group, two a byte (the low nibble first);
`scales` [..., G] uint8 are each group's exponent biased by 127. A weight [..., G * 32] is
`FP4[code] * 2 ** (scale - 127)`: every value is exact in float32 (and in bfloat16).
"""

from __future__ import annotations

import torch

# e2m1 code -> value: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6
FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 weights [..., G * 32] of `blocks` [..., G, 16] and `scales` [..., G]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}"
        )
    lut = torch.tensor(FP4, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.uint8)
    codes = torch.stack([b & 0x0F, b >> 4], dim=-1).flatten(-2).long()  # [..., G, 32]
    exp = scales.to(torch.int32) - 127
    w = torch.ldexp(lut[codes], exp.unsqueeze(-1))
    return w.flatten(-2)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks [..., K / 32, 16], scales [..., K / 32]) of `w` [..., K]: each group's scale the smallest
    power of two that brings its largest magnitude to 6 or under, each value the nearest
    code (ties to the smaller magnitude). Values on that grid come back exactly."""
    if w.shape[-1] % GROUP:
        raise ValueError(f"the last dim ({w.shape[-1]}) is not a multiple of {GROUP}")
    g = w.float().unflatten(-1, (-1, GROUP))
    amax = g.abs().amax(-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax))
    exp = exp.clamp(-127, 127)
    scaled = torch.ldexp(g, -exp.to(torch.int32).unsqueeze(-1))
    mags = torch.tensor(FP4[:8], device=w.device)
    nearest = (scaled.abs().unsqueeze(-1) - mags).abs().argmin(-1)  # first: the smaller
    codes = (nearest | (scaled < 0).long() << 3).to(torch.uint8)
    blocks = codes[..., 0::2] | codes[..., 1::2] << 4
    return blocks, (exp + 127).to(torch.uint8)
