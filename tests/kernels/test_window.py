"""Sliding-window attention in every path: the PyTorch reference against a naive oracle, the
native CPU decode kernel and the PyTorch decode path against it, the Triton kernel (under
TRITON_INTERPRET=1, and compiled on CUDA with `-m gpu`) against the reference. Contexts run
well past the window, with windows that do and do not fall on block edges."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_native, paged_attention
from kernels.reference import paged_attention_torch
from tests.kernels.test_kernels import (
    MIXED,
    gpu,
    make_case,
    naive_attention,
    needs_cuda,
    needs_triton_cpu,
    rel_err,
)

# Decodes and prompts past the window, a recompute from 0 sharing a table with its prompt.
LONG = [(1, 37), (9, 0), (1, 0), (6, 21, 7), (21, 0, 7), (1, 70), (3, 5), (20, 50), (1, 100)]


@pytest.fixture(params=[True, False], ids=["native", "pytorch"])
def decode_path(request, monkeypatch):
    """Decodes through the native CPU kernel, or through the PyTorch path."""
    if request.param and cpu_native.module() is None:
        pytest.skip("no C++ compiler here")
    if not request.param:
        monkeypatch.setenv("PENSIEVE_NATIVE_CPU", "0")
    cpu_native.module.cache_clear()
    yield request.param
    monkeypatch.undo()
    cpu_native.module.cache_clear()


@pytest.mark.parametrize("window", [1, 5, 16, 33, 1000])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_reference_window_matches_naive(decode_path, window, heads, kv_heads, dtype):
    q, k, v, meta = make_case(
        LONG, heads=heads, kv_heads=kv_heads, head_dim=32, block_size=16, dtype=dtype
    )
    out = paged_attention_torch(q, k, v, meta, 0.2, window)
    want = naive_attention(q.float(), k.float(), v.float(), meta, 0.2, window)
    assert rel_err(out.float(), want) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_the_window_matters_and_a_wide_one_is_no_window():
    q, k, v, meta = make_case(LONG, heads=4, kv_heads=2, head_dim=32, block_size=16)
    full = paged_attention_torch(q, k, v, meta, 0.2)
    assert torch.equal(paged_attention(q, k, v, meta, 0.2, window=None), full)
    assert rel_err(paged_attention_torch(q, k, v, meta, 0.2, 200), full) < 1e-6
    # Only queries at position 8 or later lose keys to a window of 8.
    windowed = paged_attention_torch(q, k, v, meta, 0.2, 8)
    assert (windowed - full).abs().max() > 1e-2


@needs_triton_cpu
@pytest.mark.parametrize("window", [1, 7, 16, 40])
@pytest.mark.parametrize("num_segs", [None, 2, 4])
def test_triton_window_matches_reference(window, num_segs):
    q, k, v, meta = make_case(LONG, heads=6, kv_heads=2, head_dim=32, block_size=16)
    from kernels.triton_attention import paged_attention_triton

    out = torch.full_like(q, float("nan"))
    paged_attention_triton(q, k, v, meta, 0.2, num_segs=num_segs, out=out, window=window)
    assert not torch.isnan(out).any()
    ref = paged_attention_torch(q, k, v, meta, 0.2, window)
    assert rel_err(out, ref) < 2e-5


@needs_triton_cpu
def test_triton_window_through_the_front():
    q, k, v, meta = make_case(MIXED, heads=4, kv_heads=4, head_dim=16, block_size=16)
    got = paged_attention(q, k, v, meta, 0.25, backend="triton", window=10)
    want = paged_attention(q, k, v, meta, 0.25, backend="torch", window=10)
    assert rel_err(got, want) < 2e-5


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [512, 1000, 4096])
def test_gpu_triton_window_matches_reference(dtype, window):
    """Compiled on CUDA: decodes at long contexts (split-KV), chunked prompts past the window
    and a recompute, GQA of Gemma 3 1B's kind (4 heads over 1, head_dim 256)."""
    subs = [(1, 8000), (1, 5000), (1, 600), (64, 3000), (32, 0, 9), (200, 32, 9), (1, 4095)]
    q, k, v, meta = make_case(
        subs, heads=4, kv_heads=1, head_dim=256, block_size=32, dtype=dtype, device="cuda"
    )
    out = paged_attention(q, k, v, meta, 256**-0.5, backend="triton", window=window)
    torch.cuda.synchronize()
    ref = paged_attention_torch(q.float(), k.float(), v.float(), meta, 256**-0.5, window)
    tol = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}[dtype]
    assert rel_err(out.float(), ref) < tol
    full = paged_attention_torch(q.float(), k.float(), v.float(), meta, 256**-0.5)
    assert rel_err(full, ref) > 10 * tol  # the window changed the answer
