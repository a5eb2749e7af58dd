"""Fused elementwise kernels of a decoder layer (Triton): fewer launches, one pass over memory.

- `add_rms_norm`: the residual add and the RMSNorm that follows it.
- `silu_mul`: SiLU(gate) * up of a gated MLP, from the fused gate/up projection's output.
- `rope_write_kv`: rotary positions on q and k, and k/v written (or quantized) into the pool.

Each rounds to the input dtype wherever the unfused PyTorch code of engine/model/decoder.py does
(every elementwise op there rounds its result), computing in float32 in between, so the
fused results equal the unfused ones up to the reduction order of the norm and the
implementation of exp/rsqrt. The PyTorch code stays the CPU path and the tests' reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant import MIN_SCALE, QuantizedKV
from kernels.triton_cache import _store_kv, pool_args


@triton.jit
def _round(x, DT: tl.constexpr):
    """float32 x rounded to DT, to nearest even as CUDA's cast does; returned as DT. bfloat16
    is rounded on the bits first (then the cast is exact): the interpreter's own cast to
    bfloat16 truncates."""
    if tl.bfloat16 == DT:
        bits = x.to(tl.int32, bitcast=True)  # int32, as _round_e4m3: no unsigned promotion
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # keep the top 16 bits
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DT)


# ---- residual add + RMSNorm -----------------------------------------------------------------


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    d_ptr,
    w_ptr,
    res_ptr,
    out_ptr,
    stride_x,
    stride_d,
    stride_res,
    stride_out,
    N: tl.constexpr,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * stride_d + cols, mask=mask, other=0.0)
        x = _round(x.to(tl.float32) + d.to(tl.float32), res_ptr.dtype.element_ty)  # torch's add
        tl.store(res_ptr + row * stride_res + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / N + eps)
    y = _round(h * rstd, x.dtype).to(tl.float32)  # RMSNorm: normed in float32, back to x's dtype
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = _round(w * y, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def add_rms_norm_triton(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [T, dim] -> (x + delta, RMSNorm(x + delta)); without delta, (x, RMSNorm(x))."""
    t, n = x.shape
    if weight.shape != (n,) or (delta is not None and delta.shape != x.shape):
        raise ValueError(f"shapes do not match: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or (delta is not None and delta.stride(-1) != 1):
        raise ValueError("dim must be the contiguous dimension")
    res = x if delta is None else torch.empty_like(x)
    d = x if delta is None else delta
    out = torch.empty(t, n, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if t == 0:
        return res, out
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(t,)](
        x,
        d,
        weight,
        res,
        out,
        x.stride(0),
        d.stride(0),
        res.stride(0),
        out.stride(0),
        N=n,
        eps=eps,
        HAS_DELTA=delta is not None,
        BLOCK=block,
        num_warps=min(max(block // 512, 1), 16),
    )
    return res, out


# ---- SiLU(gate) * up -------------------------------------------------------------------------


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_out, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + N + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    s = _round(g / (1.0 + tl.exp(-g)), dt).to(tl.float32)  # F.silu, rounded, then the product
    tl.store(out_ptr + row * stride_out + cols, _round(s * u, dt), mask=mask)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 * I] (gate, then up) -> SiLU(gate) * up [T, I]."""
    t, n2 = gate_up.shape
    if n2 % 2 or gate_up.stride(-1) != 1:
        raise ValueError(
            f"gate_up must be [T, 2 * I] and contiguous in I, got {tuple(gate_up.shape)}"
        )
    n = n2 // 2
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = min(triton.next_power_of_2(n), 1024)
    _silu_mul_kernel[(t, triton.cdiv(n, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), N=n, BLOCK=block, num_warps=4
    )
    return out


# ---- RoPE on q and k + KV write --------------------------------------------------------------


@triton.jit
def _rope(x_ptr, partner_ptr, mask, c, s, first, DT: tl.constexpr):
    """x * cos + rotate_half(x) * sin, each product and the sum rounded to DT as torch does;
    `partner_ptr` points at the other half of each head (rotate_half: [-x2, x1])."""
    x = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(partner_ptr, mask=mask, other=0.0).to(tl.float32)
    a = _round(x * c, DT).to(tl.float32)
    b = _round(p * s, DT).to(tl.float32)
    return _round(tl.where(first, a - b, a + b), DT)


@triton.jit
def _rope_write_kv_kernel(
    qkv_ptr,  # [T, (heads + 2 * kv_heads) * head_dim]: q, k, v of each token
    cos_ptr,  # [T, head_dim]
    sin_ptr,
    q_ptr,  # out: [T, heads, head_dim]
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks, block_size, kv_heads] float16, 8-bit pools only
    v_scale_ptr,
    slots_ptr,
    stride_qkv,
    stride_cos,
    stride_sin,
    stride_q_tok,
    stride_q_head,
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
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,  # 0: store as is (cast), 1: fp8 e4m3, 2: int8
    QMAX_: tl.constexpr,
    MIN_SCALE_: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    dt = q_ptr.dtype.element_ty
    half: tl.constexpr = HEAD_DIM // 2
    dims = tl.arange(0, DIM_PAD)[None, :]
    first = dims < half
    partner = tl.where(first, dims + half, dims - half)
    dim_ok = dims < HEAD_DIM
    c = tl.load(cos_ptr + token * stride_cos + dims, mask=dim_ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + token * stride_sin + dims, mask=dim_ok, other=0.0).to(tl.float32)
    row = qkv_ptr + token * stride_qkv

    # Queries: rotated into q (every token, padding included: attention reads them).
    qh = tl.arange(0, Q_HEADS_PAD)[:, None]
    q_mask = (qh < NUM_HEADS) & dim_ok
    q_src = row + qh * HEAD_DIM
    q = _rope(q_src + dims, q_src + partner, q_mask, c, s, first, dt)
    tl.store(q_ptr + token * stride_q_tok + qh * stride_q_head + dims, q, mask=q_mask)

    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot < 0:
        return  # padding token: no KV
    # Keys rotated and values as they are, into the token's slot (as triton_cache does).
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    head_ids = tl.arange(0, KV_HEADS_PAD)
    kh = head_ids[:, None]
    kv_mask = (kh < NUM_KV_HEADS) & dim_ok
    k_src = row + NUM_HEADS * HEAD_DIM + kh * HEAD_DIM
    k = _rope(k_src + dims, k_src + partner, kv_mask, c, s, first, dt)
    v_src = row + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + kh * HEAD_DIM
    v = tl.load(v_src + dims, mask=kv_mask, other=0.0)
    k_dst = k_cache_ptr + block * stride_kb + offset * stride_kt + kh * stride_kh + dims
    v_dst = v_cache_ptr + block * stride_vb + offset * stride_vt + kh * stride_vh + dims
    head_ok = head_ids < NUM_KV_HEADS
    k_scales = k_scale_ptr + block * stride_ksb + offset * stride_kst + head_ids
    v_scales = v_scale_ptr + block * stride_vsb + offset * stride_vst + head_ids
    _store_kv(
        k, v, k_dst, v_dst, k_scales, v_scales, kv_mask, head_ok, k_cache_ptr, v_cache_ptr,
        QUANT, QMAX_, MIN_SCALE_,
    )  # fmt: skip


def rope_write_kv_triton(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor | QuantizedKV,
    v_cache: torch.Tensor | QuantizedKV,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """qkv [T, (heads + 2 * kv_heads) * head_dim], cos/sin [T, head_dim] (or [T, 1, head_dim])
    -> rotated q [T, heads, head_dim]; rotated k and v go to their slots of the pool (-1:
    none), quantized for an 8-bit pool."""
    t = qkv.shape[0]
    cos, sin = cos.reshape(t, -1), sin.reshape(t, -1)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.shape != (t, width) or cos.shape != (t, head_dim) or sin.shape != cos.shape:
        raise ValueError(
            f"shapes do not match: qkv {tuple(qkv.shape)}, cos {tuple(cos.shape)}, "
            f"heads {num_heads}/{num_kv_heads} of {head_dim}"
        )
    if head_dim % 2 or k_cache.shape[2:] != (num_kv_heads, head_dim) or slots.shape != (t,):
        raise ValueError(f"pool {tuple(k_cache.shape)} or slots {tuple(slots.shape)} do not fit")
    if qkv.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("the last dimension must be contiguous")
    quant, qmax, k_data, v_data, k_scale, v_scale = pool_args(k_cache, v_cache)
    if k_data.stride(-1) != 1 or v_data.stride(-1) != 1:
        raise ValueError("head_dim must be the contiguous dimension of the pool")
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    _rope_write_kv_kernel[(t,)](
        qkv,
        cos,
        sin,
        q,
        k_data,
        v_data,
        k_scale,
        v_scale,
        slots,
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        q.stride(0),
        q.stride(1),
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
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        Q_HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_data.shape[1],
        QUANT=quant,
        QMAX_=qmax,
        MIN_SCALE_=MIN_SCALE,
        num_warps=4 if triton.next_power_of_2(num_heads) * head_dim <= 4096 else 8,
    )
    return q
