"""Paged attention kernels: Triton on CUDA, the PyTorch reference elsewhere. One call for both."""

from __future__ import annotations

import torch

from kernels.metadata import AttentionMetadata
from kernels.quant import QuantizedKV
from kernels.reference import paged_attention_torch, write_kv_torch

__all__ = ["AttentionMetadata", "QuantizedKV", "paged_attention", "write_kv", "pick_backend"]


def pick_backend(device: torch.device | str, backend: str | None = None) -> str:
    if backend is not None:
        if backend not in ("triton", "torch"):
            raise ValueError(f"unknown attention backend {backend!r}")
        return backend
    return "triton" if torch.device(device).type == "cuda" else "torch"


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, backend=None):
    """q/out [num_tokens, num_heads, head_dim]; caches [num_blocks, block_size, kv_heads, head_dim]
    (tensors of q's dtype, or `QuantizedKV` 8-bit pools)."""
    if pick_backend(q.device, backend) == "triton":
        from kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, meta, scale)
    return paged_attention_torch(q, k_cache, v_cache, meta, scale)


def write_kv(k_cache, v_cache, k, v, slots, backend=None) -> None:
    """Write new K/V [num_tokens, kv_heads, head_dim] into their slots of the paged pool."""
    if pick_backend(k.device, backend) == "triton":
        from kernels.triton_cache import write_kv_triton

        return write_kv_triton(k_cache, v_cache, k, v, slots)
    return write_kv_torch(k_cache, v_cache, k, v, slots)
