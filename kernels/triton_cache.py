"""Triton slot-mapping write: new K/V rows go to their flat slots of the paged pool.

An 8-bit pool (`QuantizedKV`) gets codes and a float16 scale per token and KV head, computed
as `kernels.quant.quantize` does (amax / QMAX, the scale rounded to float16 before dividing,
clamped; int8 rounds half up)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant import MIN_SCALE, QMAX, QuantizedKV

QUANT_NONE, QUANT_FP8, QUANT_INT8 = 0, 1, 2
QUANT_KIND = {"fp8": QUANT_FP8, "int8": QUANT_INT8}


@triton.jit
def _round_e4m3(y):
    """float32 y (|y| <= 448) rounded to the nearest e4m3 value, ties to even, as torch's cast
    does; the cast that follows is then exact. (The interpreter's own float8 cast drops the
    carry of a rounded-up mantissa: 124.3 became 64, not 128.)"""
    bits = y.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    # |y| >= 2**-6 (e4m3 normals): keep 3 of the 23 mantissa bits; a carry moves the exponent.
    normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & -1048576
    # Below: multiples of 2**-9 (e4m3 subnormals), rounded by the float32 addition itself.
    a = mag.to(tl.float32, bitcast=True)
    sub = ((a + 16384.0) - 16384.0).to(tl.int32, bitcast=True)
    out = tl.where(mag < 0x3C800000, sub, normal) | (bits & -2147483648)
    return out.to(tl.float32, bitcast=True)


@triton.jit
def _quantize_rows(x, QUANT: tl.constexpr, QMAX_: tl.constexpr, MIN_SCALE_: tl.constexpr):
    """x [HEADS_PAD, DIM_PAD] float32 (masked lanes 0) -> codes, float16 scale per row."""
    amax = tl.max(tl.abs(x), 1)
    scale = tl.maximum(tl.div_rn(amax, QMAX_), MIN_SCALE_).to(tl.float16)
    y = tl.div_rn(x, scale.to(tl.float32)[:, None])
    y = tl.minimum(tl.maximum(y, -QMAX_), QMAX_)
    if QUANT == 1:
        codes = _round_e4m3(y).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        codes = tl.floor(y + 0.5).to(tl.int8)
    return codes, scale


@triton.jit
def _store_kv(
    k,
    v,
    k_dst,
    v_dst,
    k_scales,
    v_scales,
    mask,
    head_ok,
    k_cache_ptr,
    v_cache_ptr,
    QUANT: tl.constexpr,
    QMAX_: tl.constexpr,
    MIN_SCALE_: tl.constexpr,
):
    """One token's K and V rows [HEADS_PAD, DIM_PAD] into their pool addresses: cast to the
    pool's dtype, or 8-bit codes plus a float16 scale per head (`k_scales`: the addresses of
    the token's per-head scales, `head_ok` their mask)."""
    if QUANT == 0:
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
    else:
        k_codes, k_scale = _quantize_rows(k.to(tl.float32), QUANT, QMAX_, MIN_SCALE_)
        v_codes, v_scale = _quantize_rows(v.to(tl.float32), QUANT, QMAX_, MIN_SCALE_)
        tl.store(k_dst, k_codes, mask=mask)
        tl.store(v_dst, v_codes, mask=mask)
        tl.store(k_scales, k_scale, mask=head_ok)
        tl.store(v_scales, v_scale, mask=head_ok)


@triton.jit
def _write_kv_kernel(
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks, block_size, kv_heads] float16, 8-bit pools only
    v_scale_ptr,
    k_ptr,
    v_ptr,
    slots_ptr,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ksb,
    stride_kst,
    stride_vsb,
    stride_vst,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,  # 0: store as is (cast), 1: fp8 e4m3, 2: int8
    QMAX_: tl.constexpr,
    MIN_SCALE_: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot < 0:
        return  # padding token
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    head_ids = tl.arange(0, HEADS_PAD)
    heads = head_ids[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_k_tok + heads * stride_k_head + dims, mask=mask, other=0.0)
    v = tl.load(v_ptr + token * stride_v_tok + heads * stride_v_head + dims, mask=mask, other=0.0)
    k_dst = k_cache_ptr + block * stride_kb + offset * stride_kt + heads * stride_kh + dims
    v_dst = v_cache_ptr + block * stride_vb + offset * stride_vt + heads * stride_vh + dims
    head_ok = head_ids < NUM_KV_HEADS
    k_scales = k_scale_ptr + block * stride_ksb + offset * stride_kst + head_ids
    v_scales = v_scale_ptr + block * stride_vsb + offset * stride_vst + head_ids
    _store_kv(
        k, v, k_dst, v_dst, k_scales, v_scales, mask, head_ok, k_cache_ptr, v_cache_ptr,
        QUANT, QMAX_, MIN_SCALE_,
    )  # fmt: skip


def pool_args(
    k_cache: torch.Tensor | QuantizedKV, v_cache: torch.Tensor | QuantizedKV
) -> tuple[int, float, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a kernel writing the pool takes: (QUANT, QMAX, K and V data, K and V scales); the
    scales are the data tensors (unused) for a 16-bit pool."""
    if not (isinstance(k_cache, QuantizedKV) or isinstance(v_cache, QuantizedKV)):
        return QUANT_NONE, 1.0, k_cache, v_cache, k_cache, v_cache
    if not (isinstance(k_cache, QuantizedKV) and isinstance(v_cache, QuantizedKV)):
        raise ValueError("K and V pools must both be 8-bit or neither")
    if k_cache.fmt != v_cache.fmt:
        raise ValueError("K and V pools must share their 8-bit format")
    if k_cache.scales.stride(-1) != 1 or v_cache.scales.stride(-1) != 1:
        raise ValueError("kv_heads must be the contiguous dimension of the scales")
    quant, qmax = QUANT_KIND[k_cache.fmt], QMAX[k_cache.fmt]
    return quant, qmax, k_cache.codes, v_cache.codes, k_cache.scales, v_cache.scales


def write_kv_triton(
    k_cache: torch.Tensor | QuantizedKV,
    v_cache: torch.Tensor | QuantizedKV,
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
    quant, qmax, k_data, v_data, k_scale, v_scale = pool_args(k_cache, v_cache)
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_data.stride(-1) != 1 or v_data.stride(-1) != 1:
        raise ValueError("head_dim must be the contiguous dimension")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k_data,
        v_data,
        k_scale,
        v_scale,
        k,
        v,
        slots,
        k_data.stride(0),
        k_data.stride(1),
        k_data.stride(2),
        v_data.stride(0),
        v_data.stride(1),
        v_data.stride(2),
        k_scale.stride(0) if quant else 0,
        k_scale.stride(1) if quant else 0,
        v_scale.stride(0) if quant else 0,
        v_scale.stride(1) if quant else 0,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_data.shape[1],
        QUANT=quant,
        QMAX_=qmax,
        MIN_SCALE_=MIN_SCALE,
    )
