"""CPU only: linears over 4-bit weights with a scale and zero point per 32 inputs, as a GGUF's
Q4_0 / Q4_1 blocks hold them (engine/model/gguf_weights.py), never dequantized.

PyTorch's `_weight_int4pack_mm_for_cpu` reads codes packed two a byte and computes
w = (q - 8) * scale + zero per group; a Q4 block's w = d * q + m is that with scale = d and
zero = m + 8 d. Scales and zeros must be in the input's dtype: bfloat16 (the kernel's fast
path: d and m lose float16's 3 last bits, as a bfloat16 copy of the dense weight rounds it)
or float32 (within float32 rounding of the dequantized weight).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.gguf_weights import GROUP, Q4Weight


class Int4Linear(nn.Module):
    """y = x W^T (+ b), W [N, K] held as packed 4-bit codes and per-group scales and zeros."""

    def __init__(self, w: Q4Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = w.codes.shape
        if self.in_features % GROUP:
            raise ValueError(f"in_features {self.in_features} is not a multiple of {GROUP}")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.codes.to(torch.int32), 1)
        zeros = w.mins + 8 * w.scales
        # [K / 32, N, 2]: the kernel's layout
        sz = torch.stack([w.scales.t(), zeros.t()], dim=-1).to(dtype).contiguous()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", sz)
        self.bias = None if bias is None else bias.detach().to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(self.scales_and_zeros.dtype).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2, self.packed, GROUP, self.scales_and_zeros
        )
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def weight_bytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes


def swap_int4(model: nn.Module, weights: dict[str, Q4Weight], dtype: torch.dtype) -> int:
    """Each nn.Linear of `model` whose weight is in `weights` (by its parameter name) becomes
    an Int4Linear; returns how many."""
    swaps = [
        (parent, name, child, f"{pname}.{name}.weight".lstrip("."))
        for pname, parent in model.named_modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    n = 0
    for parent, name, child, wname in swaps:
        if wname in weights:
            setattr(parent, name, Int4Linear(weights[wname], child.bias, dtype))
            n += 1
    return n
