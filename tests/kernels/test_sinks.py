"""Attention sinks (gpt-oss: a learned logit per query head in every softmax's denominator)
in every path: the PyTorch reference (prompts, and decodes through the native CPU kernel or
the PyTorch path) against a naive oracle, with and without a sliding window; the Triton
kernel (under TRITON_INTERPRET=1, and compiled on CUDA with `-m gpu`) against the reference,
with split-KV segments (whose merge adds the sink) and without."""

from __future__ import annotations

import pytest
import torch

from kernels import paged_attention
from kernels.reference import paged_attention_torch
from tests.kernels.test_kernels import (
    gpu,
    make_case,
    naive_attention,
    needs_cuda,
    needs_triton_cpu,
    rel_err,
)
from tests.kernels.test_window import LONG, decode_path  # noqa: F401 (a fixture)


def sinks_for(heads: int, seed: int = 1) -> torch.Tensor:
    """Sinks of either sign, some large enough to take most of a row's mass."""
    return torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2.0


@pytest.mark.parametrize("window", [None, 5, 33])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_reference_sinks_match_naive(decode_path, window, heads, kv_heads, dtype):  # noqa: F811
    q, k, v, meta = make_case(
        LONG, heads=heads, kv_heads=kv_heads, head_dim=32, block_size=16, dtype=dtype
    )
    sinks = sinks_for(heads).to(dtype)
    out = paged_attention_torch(q, k, v, meta, 0.2, window, sinks)
    want = naive_attention(q.float(), k.float(), v.float(), meta, 0.2, window, sinks.float())
    assert rel_err(out.float(), want) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_sinks_matter_and_very_low_ones_are_none(decode_path):  # noqa: F811
    """A sink of -1e4 takes no mass: the output is the plain softmax's. Real sinks shrink
    every row's output (their share of the mass goes nowhere)."""
    q, k, v, meta = make_case(LONG, heads=4, kv_heads=2, head_dim=32, block_size=16)
    plain = paged_attention_torch(q, k, v, meta, 0.2, 16)
    off = paged_attention_torch(q, k, v, meta, 0.2, 16, torch.full((4,), -1e4))
    assert rel_err(off, plain) < 1e-5
    sunk = paged_attention_torch(q, k, v, meta, 0.2, 16, sinks_for(4))
    assert rel_err(sunk, plain) > 1e-2
    assert (sunk.norm(dim=-1) <= plain.norm(dim=-1) + 1e-5).all()


@needs_triton_cpu
@pytest.mark.parametrize("window", [None, 7, 40])
@pytest.mark.parametrize("num_segs", [None, 1, 4])
def test_triton_sinks_match_reference(window, num_segs):
    q, k, v, meta = make_case(LONG, heads=6, kv_heads=2, head_dim=32, block_size=16)
    from kernels.triton_attention import paged_attention_triton

    sinks = sinks_for(6)
    out = torch.full_like(q, float("nan"))
    paged_attention_triton(
        q, k, v, meta, 0.2, num_segs=num_segs, out=out, window=window, sinks=sinks
    )
    assert not torch.isnan(out).any()
    ref = paged_attention_torch(q, k, v, meta, 0.2, window, sinks)
    assert rel_err(out, ref) < 2e-5
    assert rel_err(paged_attention_torch(q, k, v, meta, 0.2, window), ref) > 1e-2


@needs_triton_cpu
def test_triton_sinks_through_the_front():
    q, k, v, meta = make_case(LONG, heads=4, kv_heads=4, head_dim=16, block_size=16)
    sinks = sinks_for(4)
    got = paged_attention(q, k, v, meta, 0.25, backend="triton", window=10, sinks=sinks)
    want = paged_attention(q, k, v, meta, 0.25, backend="torch", window=10, sinks=sinks)
    assert rel_err(got, want) < 2e-5


def test_sinks_of_the_wrong_shape_are_refused():
    from kernels.triton_attention import paged_attention_triton

    q, k, v, meta = make_case([(1, 5)], heads=4, kv_heads=2, head_dim=16, block_size=16)
    with pytest.raises(ValueError, match="one per query head"):
        paged_attention_triton(q, k, v, meta, 0.25, sinks=torch.zeros(2))


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 128])
def test_gpu_triton_sinks_and_window_match_reference(dtype, window):
    """Compiled on CUDA with gpt-oss's attention shape (64 query heads over 8 KV heads,
    head_dim 64, a window of 128 on sliding layers): decodes at long contexts (split-KV: the
    sink joins in the merge), prompts past the window, a recompute sharing its table."""
    subs = [(1, 6000), (1, 3000), (1, 300), (64, 2000), (32, 0, 9), (200, 32, 9), (1, 127)]
    q, k, v, meta = make_case(
        subs, heads=64, kv_heads=8, head_dim=64, block_size=32, dtype=dtype, device="cuda"
    )
    sinks = sinks_for(64).to("cuda", dtype)
    out = paged_attention(q, k, v, meta, 0.125, backend="triton", window=window, sinks=sinks)
    torch.cuda.synchronize()
    qf, kf, vf = q.float(), k.float(), v.float()
    ref = paged_attention_torch(qf, kf, vf, meta, 0.125, window, sinks.float())
    tol = {torch.float32: 2e-5, torch.bfloat16: 2.5e-2}[dtype]
    assert rel_err(out.float(), ref) < tol
    plain = paged_attention_torch(qf, kf, vf, meta, 0.125, window)
    assert rel_err(plain, ref) > 10 * tol  # the sinks changed the answer
