"""Block copies between the KV tiers in one launch: many scattered blocks, every layer or one.

A swap moves chunks whose blocks are scattered on both sides (a conversation's chunks are
swapped out at different times, and whatever GPU blocks are free take them back), so a
step's swap is mostly runs of one block. Copied run by run, that is one transfer per run,
per layer, per K/V (and per scales tensor of an 8-bit KV): a swap-in of 17 chunks of a
40-layer model issues 1,360 small copies before the forward can start. This kernel copies
a list of (source block, destination block) pairs in one launch per layer (swap-in, which
is pipelined layer by layer) or for all layers (swap-out): each program moves one tile of
one block of one layer's K or V.

The CPU tier is page-locked, so on CUDA the kernel reads and writes it directly through
unified addressing (Triton accepts pointers the GPU can reach). Under TRITON_INTERPRET=1
it runs on CPU tensors, which is how the tests check its indexing without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 2048  # words of a block per program


@triton.jit
def _copy_blocks(
    src,
    dst,
    src_ids,
    dst_ids,
    first_layer,
    src_layer,
    src_kv,
    src_block,
    dst_layer,
    dst_kv,
    dst_block,
    WORDS: tl.constexpr,
    TILE_: tl.constexpr,
):
    pair = tl.program_id(0)
    part = tl.program_id(1)  # layer * 2 + K/V, from first_layer
    tile = tl.program_id(2)
    layer = (first_layer + part // 2).to(tl.int64)  # offsets pass 2**31 in a large tier
    kv = part % 2
    s = tl.load(src_ids + pair).to(tl.int64)
    d = tl.load(dst_ids + pair).to(tl.int64)
    offs = tile * TILE_ + tl.arange(0, TILE_)
    mask = offs < WORDS
    x = tl.load(src + layer * src_layer + kv * src_kv + s * src_block + offs, mask=mask)
    tl.store(dst + layer * dst_layer + kv * dst_kv + d * dst_block + offs, x, mask=mask)


def words(t: torch.Tensor) -> torch.Tensor:
    """A tier tensor [layers, 2, blocks, ...] as [layers, 2, blocks, words]: 4-byte words where
    a block's bytes allow (fewer, wider loads), else bytes."""
    flat = t.view(*t.shape[:3], -1)
    per_block = flat.shape[-1] * flat.element_size()
    return flat.view(torch.int32 if per_block % 4 == 0 else torch.uint8)


def copy_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    layers: range,
) -> None:
    """dst[l, kv, dst_ids[i]] = src[l, kv, src_ids[i]] for every pair i, K and V, l in `layers`.

    src, dst: tier tensors of one shape past the block dimension, contiguous within a block;
    the ids: int64, on the device the kernel runs on (or page-locked)."""
    if not len(src_ids) or not len(layers):
        return
    if layers.step != 1:
        raise ValueError("layers must be a contiguous range")
    s, d = words(src), words(dst)
    if s.shape[3] != d.shape[3] or s.dtype != d.dtype:
        raise ValueError(f"blocks differ: {tuple(src.shape)} {src.dtype} vs {tuple(dst.shape)}")
    if s.stride(3) != 1 or d.stride(3) != 1:
        raise ValueError("a block must be contiguous")
    n = s.shape[3]
    grid = (len(src_ids), 2 * len(layers), triton.cdiv(n, TILE))
    _copy_blocks[grid](
        s, d, src_ids, dst_ids, layers.start,
        s.stride(0), s.stride(1), s.stride(2),
        d.stride(0), d.stride(1), d.stride(2),
        WORDS=n, TILE_=TILE,
    )  # fmt: skip
