"""A GGUF's 4-bit linear weights as they are stored (Q4_0, Q4_1), by the decoder's own names.

A Q4 block is 32 weights of one row with a scale d and, for Q4_1, a minimum m (both
float16): w = d * q + m, q in 0..15 (Q4_0: w = d * (q - 8), i.e. m = -8 d). Kept as codes,
scales and minimums, they dequantize in float32 to exactly the values transformers'
conversion writes (engine/model/loader.py, `convert_bundled`), which the tests check.

llama.cpp's converter permutes the rows of Llama's q and k projections (its RoPE pairs
adjacent dims, transformers' halves); transformers undoes it, and so does `_unpermute`
here: a row permutation, so it moves whole blocks and their scales with them.
Any other type (F32 norms, the Q8_0 embedding) is not read here: those tensors stay the
dequantized checkpoint's.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.model.shapes import ModelArgs

if TYPE_CHECKING:  # numpy comes with gguf, which only a read needs
    import numpy as np

log = logging.getLogger(__name__)

GROUP = 32
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}  # fp16 d (and fp16 m), then 16 bytes of codes
# GGUF tensor -> (the decoder's linear, its rows' order within it)
_PARTS = {
    "attn_q": ("wqkv", 0),
    "attn_k": ("wqkv", 1),
    "attn_v": ("wqkv", 2),
    "attn_output": ("wo", 0),
    "ffn_gate": ("w13", 0),
    "ffn_up": ("w13", 1),
    "ffn_down": ("w2", 0),
}
_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


@dataclass
class Q4Weight:
    """One linear's weight [N, K] as 4-bit codes with per-32 scale and minimum:
    w[n, k] = scales[n, k // 32] * codes[n, k] + mins[n, k // 32]."""

    codes: torch.Tensor  # uint8 [N, K], each 0..15
    scales: torch.Tensor  # float32 [N, K / 32] (float16 values)
    mins: torch.Tensor  # float32 [N, K / 32]

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        q = self.codes.float().view(n, k // GROUP, GROUP)
        # Two roundings (product, then sum) as gguf's numpy dequantizer: not a fused multiply-add
        w = q * self.scales[..., None]
        return (w + self.mins[..., None]).view(n, k)

    @staticmethod
    def cat(parts: list[Q4Weight]) -> Q4Weight:
        return Q4Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in _FIELDS))


_FIELDS = ("codes", "scales", "mins")


def _blocks(raw: np.ndarray, kind: str) -> Q4Weight:
    """raw uint8 [N, K / 32 * block bytes] -> codes, scales and minimums."""
    n = raw.shape[0]
    # a writable copy of the file's map
    b = torch.from_numpy(raw.copy()).view(n, -1, _BLOCK_BYTES[kind])
    d = b[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    if kind == "Q4_1":
        m, qs = b[..., 2:4].contiguous().view(torch.float16)[..., 0].float(), b[..., 4:]
    else:
        m, qs = -8 * d, b[..., 2:]
    # byte j holds weight j in its low nibble and weight j + 16 in its high one
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(n, -1)
    return Q4Weight(codes, d, m)


def _unpermute(w: Q4Weight, heads: int) -> Q4Weight:
    """transformers' `_reverse_permute_weights` on rows: [heads, half, 2] -> [heads, 2, half]."""

    def back(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(heads, t.shape[0] // heads // 2, 2, -1).transpose(1, 2).reshape(t.shape)

    return Q4Weight(*(back(getattr(w, f)) for f in _FIELDS))


def read_q4(path: Path, args: ModelArgs) -> dict[str, Q4Weight]:
    """The Q4_0 / Q4_1 linears of a Llama-family GGUF by the decoder's own weight names
    (`layers.{i}.wqkv.weight`, ...); a linear any of whose parts has another type is left
    out (logged), and so served from the dequantized checkpoint."""
    import gguf

    reader = gguf.GGUFReader(path)
    parts: dict[str, dict[int, Q4Weight]] = {}
    other: Counter[str] = Counter()
    dense: set[str] = set()
    for t in reader.tensors:
        match = _NAME.fullmatch(t.name)
        kind = t.tensor_type.name
        if match is None or match[2] not in _PARTS:
            if len(t.shape) > 1:  # a matrix not read here (the embedding): dequantized
                other[f"{t.name} {kind}"] += 1
            continue
        own, order = _PARTS[match[2]]
        own = f"layers.{match[1]}.{own}.weight"
        if kind not in _BLOCK_BYTES:
            dense.add(own)
            other[kind] += 1
            continue
        w = _blocks(t.data, kind)
        if match[2] in ("attn_q", "attn_k"):
            w = _unpermute(w, args.n_heads if match[2] == "attn_q" else args.n_kv_heads)
        parts.setdefault(own, {})[order] = w
    out = {
        name: Q4Weight.cat([ps[i] for i in sorted(ps)])
        for name, ps in parts.items()
        if name not in dense
    }
    if other:
        log.info(
            "GGUF weights kept dequantized (no 4-bit kernel for their type): %s",
            ", ".join(f"{k} x{n}" for k, n in sorted(other.items())),
        )
    return out
