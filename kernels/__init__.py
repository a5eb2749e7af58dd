"""Paged attention kernels: Triton on CUDA, the PyTorch reference elsewhere. One call for both.

The fused elementwise kernels (`add_rms_norm`, `silu_mul`, `rope_write_kv`) are Triton only:
the model calls them on its Triton path and keeps its PyTorch code elsewhere."""

from __future__ import annotations

import torch

from kernels.metadata import AttentionMetadata
from kernels.quant import QuantizedKV
from kernels.reference import paged_attention_torch, write_kv_torch

__all__ = [
    "AttentionMetadata",
    "QuantizedKV",
    "add_rms_norm",
    "paged_attention",
    "pick_backend",
    "rope_write_kv",
    "silu_mul",
    "write_kv",
]


def pick_backend(device: torch.device | str, backend: str | None = None) -> str:
    if backend is not None:
        if backend not in ("triton", "torch"):
            raise ValueError(f"unknown attention backend {backend!r}")
        return backend
    return "triton" if torch.device(device).type == "cuda" else "torch"


def paged_attention(
    q,
    k_cache,
    v_cache,
    meta: AttentionMetadata,
    scale: float,
    backend=None,
    window=None,
    sinks=None,
):
    """q/out [num_tokens, num_heads, head_dim]; caches [num_blocks, block_size, kv_heads, head_dim]
    (tensors of q's dtype, or `QuantizedKV` 8-bit pools). `window`: the layer's sliding window
    (the query at position i sees the key at j iff 0 <= i - j < window); None: no window.
    `sinks` [num_heads] (gpt-oss): each head's sink logit, one more term of every softmax's
    denominator (it takes probability mass and adds no value); None: none."""
    if pick_backend(q.device, backend) == "triton":
        from kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, meta, scale, window=window, sinks=sinks)
    return paged_attention_torch(q, k_cache, v_cache, meta, scale, window, sinks)


def write_kv(k_cache, v_cache, k, v, slots, backend=None) -> None:
    """Write new K/V [num_tokens, kv_heads, head_dim] into their slots of the paged pool."""
    if pick_backend(k.device, backend) == "triton":
        from kernels.triton_cache import write_kv_triton

        return write_kv_triton(k_cache, v_cache, k, v, slots)
    return write_kv_torch(k_cache, v_cache, k, v, slots)


def add_rms_norm(x, delta, weight, eps: float):
    """x, delta [T, dim] -> (x + delta, RMSNorm(x + delta)) in one pass; delta None: no add."""
    from kernels.fused import add_rms_norm_triton

    return add_rms_norm_triton(x, delta, weight, eps)


def silu_mul(gate_up):
    """[T, 2 * I] (gate, then up) -> SiLU(gate) * up [T, I]."""
    from kernels.fused import silu_mul_triton

    return silu_mul_triton(gate_up)


def rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads, head_dim):
    """Rotary positions on the q and k of `qkv` [T, (heads + 2 * kv_heads) * head_dim]; k and
    v go to their slots of the pool (quantized for an 8-bit pool); returns q [T, heads, head_dim]."""
    from kernels.fused import rope_write_kv_triton

    return rope_write_kv_triton(
        qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads, head_dim
    )
