"""A GGUF's 4-bit linear weights as they are stored (Q4_0, Q4_1, Q4_K), by the decoder's own
names.

A Q4 block is 32 weights of one row with a scale d and, for Q4_1, a minimum m (both
float16): w = d * q + m, q in 0..15 (Q4_0: w = d * (q - 8), i.e. m = -8 d). A Q4_K
super-block is 256 weights: float16 d and dmin, and for each of its 8 sub-blocks of 32 a
6-bit scale code sc and minimum code mc: w = (d * sc) * q - dmin * mc, i.e. a per-32 scale
d * sc and minimum -dmin * mc (both products exact in float32: 11 by 6 bits). Kept as codes,
scales and minimums, they dequantize in float32 to exactly the values transformers'
conversion writes (engine/model/loader.py, `convert_bundled`), which the tests check.

llama.cpp's converter permutes the rows of Llama's q and k projections (its RoPE pairs
adjacent dims, transformers' halves); transformers undoes it, and so does `_unpermute`
here: a row permutation, so it moves whole blocks and their scales with them. Other
families (Gemma 3) are written unpermuted.

No kernel here takes 5, 6 or 8 bits: a linear any part of which is Q5_0, Q5_1, Q5_K, Q6_K,
Q8_0 or a float type is not read here and stays the dequantized checkpoint's (`KEPT_DENSE`:
why not per-channel int8), as do the other matrices (the Q8_0 embedding). A linear of any
other type (Q2_K, Q3_K, the IQ types...) is refused by name.
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
    import gguf
    import numpy as np

log = logging.getLogger(__name__)

GROUP = 32
# Bytes a block and the weights it holds: Q4_0 / Q4_1: fp16 d (and fp16 m), 16 bytes of codes;
# Q4_K: fp16 d and dmin, 12 bytes of 6-bit scale and minimum codes, 128 bytes of codes
_BLOCK = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q4_K": (144, 256)}
INT4 = tuple(_BLOCK)
# Served dequantized (the converted checkpoint's values), not as per-channel int8 weights
# (torch's `_weight_int8pack_mm`): at 8 rows, one thread, on an AVX512-BF16 CPU, int8 was
# slower than the dense bfloat16 linear (Gemma 3 270M's shapes, medians of 300: wqkv
# 1536x640 210 us vs 144 dense, 95 oneDNN-packed; w13 4096x640 565 vs 347, 217; w2 640x2048
# 265 vs 192, 116), and in float32 20-80x slower (4-35 ms: no vectorized float32 path);
# and it rounds each row to 8 bits of its own largest value (a Q5_0 weight's per-32 scale
# is lost): weights within 0.4% of the row's largest, a linear's outputs (8 random rows)
# within 0.8-3.5% of their largest, 3-9x a bfloat16 copy's 0.24-0.38%.
KEPT_DENSE = ("F32", "F16", "BF16", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")
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


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes [..., 2] -> their float16 value in float32 [...]."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _q4_k(b: torch.Tensor) -> Q4Weight:
    """Q4_K super-blocks uint8 [N, K / 256, 144] -> codes and per-32 scales and minimums."""
    n = b.shape[0]
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    # 12 bytes: sub-blocks 0-3 have their scale and minimum codes in the low 6 bits of bytes
    # 0-3 and 4-7; sub-blocks 4-7 have theirs' low 4 bits in bytes 8-11 (scale low, minimum
    # high nibble) and their top 2 bits in the top 2 bits of bytes 0-3 and 4-7
    s = b[..., 4:16].view(n, -1, 3, 4)
    lo, mi, hi = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=-1).float()
    mc = torch.cat([mi & 0x3F, (hi >> 4) | ((mi >> 2) & 0x30)], dim=-1).float()
    # 4 runs of 32 bytes: each holds 64 weights, the first 32 in its low nibbles
    qs = b[..., 16:].view(n, -1, 4, 1, 32)
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-2).reshape(n, -1)
    scales = (d[..., None] * sc).reshape(n, -1)
    return Q4Weight(codes, scales, -(dmin[..., None] * mc).reshape(n, -1))


def _blocks(raw: np.ndarray, kind: str) -> Q4Weight:
    """raw uint8 [N, K / weights a block * block bytes] -> codes, scales and minimums."""
    if kind not in _BLOCK:
        raise ValueError(f"no 4-bit weights of GGUF type {kind}: only {', '.join(INT4)}")
    n = raw.shape[0]
    # a writable copy of the file's map
    b = torch.from_numpy(raw.copy()).view(n, -1, _BLOCK[kind][0])
    if kind == "Q4_K":
        return _q4_k(b)
    d = _f16(b[..., 0:2])
    if kind == "Q4_1":
        m, qs = _f16(b[..., 2:4]), b[..., 4:]
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


def _architecture(reader) -> str:
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def read_q4(path: Path | gguf.GGUFReader, args: ModelArgs) -> dict[str, Q4Weight]:
    """The 4-bit (Q4_0, Q4_1, Q4_K) linears of a GGUF by the decoder's own weight names
    (`layers.{i}.wqkv.weight`, ...). A fused linear (wqkv, w13) is 4-bit only when all its
    parts are; a linear any of whose parts is another type (`KEPT_DENSE`) is left out, and
    so served from the dequantized checkpoint (both logged, counted); any other type is
    refused. `path` may be the file already open (gguf's reader takes ~10-20 s over Gemma's
    262k-token vocabulary)."""
    import gguf

    reader = path if isinstance(path, gguf.GGUFReader) else gguf.GGUFReader(path)
    permuted = _architecture(reader) == "llama"  # llama.cpp permutes only Llama's q and k
    parts: dict[str, dict[int, Q4Weight]] = {}
    kinds: dict[str, set[str]] = {}
    other: Counter[str] = Counter()
    for t in reader.tensors:
        match = _NAME.fullmatch(t.name)
        kind = t.tensor_type.name
        if match is None or match[2] not in _PARTS:
            if len(t.shape) > 1:  # a matrix not read here (the embedding): dequantized
                other[f"{t.name} {kind}"] += 1
            continue
        if kind not in INT4 and kind not in KEPT_DENSE:
            raise ValueError(
                f"GGUF tensor {t.name} is {kind}: weights='gguf' serves {', '.join(INT4)} "
                f"as 4-bit and {', '.join(KEPT_DENSE)} dequantized; use weights='auto'"
            )
        own, order = _PARTS[match[2]]
        own = f"layers.{match[1]}.{own}.weight"
        kinds.setdefault(own, set()).add(kind)
        if kind in INT4:
            w = _blocks(t.data, kind)
            if permuted and match[2] in ("attn_q", "attn_k"):
                w = _unpermute(w, args.n_heads if match[2] == "attn_q" else args.n_kv_heads)
            parts.setdefault(own, {})[order] = w
    out, forms = {}, Counter()
    for own, ks in kinds.items():
        form = "+".join(sorted(ks))
        if ks <= set(INT4):
            ps = parts[own]
            out[own] = Q4Weight.cat([ps[i] for i in sorted(ps)])
            forms[f"4-bit {own.split('.')[2]} {form}"] += 1
        else:
            forms[f"dequantized {own.split('.')[2]} {form}"] += 1
    log.info("GGUF linears: %s", ", ".join(f"{k} x{n}" for k, n in sorted(forms.items())))
    if other:
        log.info(
            "GGUF matrices kept dequantized: %s",
            ", ".join(f"{k} x{n}" for k, n in sorted(other.items())),
        )
    return out
