"""Triton slot-mapping write: new K/V rows go to their flat slots of the paged pool."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_cache_ptr,
    v_cache_ptr,
    k_ptr,
    v_ptr,
    slots_ptr,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot < 0:
        return  # padding token
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_k_tok + heads * stride_k_head + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_v_tok + heads * stride_v_head + dims, mask=mask)
    k_dst = k_cache_ptr + block * stride_kb + offset * stride_kt + heads * stride_kh + dims
    v_dst = v_cache_ptr + block * stride_vb + offset * stride_vt + heads * stride_vh + dims
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """k/v [T, kv_heads, head_dim] -> caches [num_blocks, block_size, kv_heads, head_dim] at slots [T]."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if k_cache.shape[2:] != k.shape[1:] or v.shape != k.shape or slots.shape != (num_tokens,):
        raise ValueError(
            f"shapes do not match: cache {tuple(k_cache.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}, slots {tuple(slots.shape)}"
        )
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("head_dim must be the contiguous dimension")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k_cache,
        v_cache,
        k,
        v,
        slots,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
    )
