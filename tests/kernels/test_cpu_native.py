"""The native CPU decode attention (kernels/cpu_native.py) against the PyTorch path: the same
outputs over paged pools, with decode rows among prompt rows and padding rows."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_native
from kernels.metadata import AttentionMetadata
from kernels.reference import paged_attention_torch

pytestmark = pytest.mark.skipif(cpu_native.module() is None, reason="no C++ compiler here")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def batch(lens: list[int], q_lens: list[int], heads: int, kv_heads: int, dtype, blocks=96):
    """A pool of random keys and values and sub-requests reading `lens` keys each through
    random block tables (the last q_lens[s] keys are the sub-request's own queries)."""
    gen = torch.Generator().manual_seed(sum(lens) + heads)
    bs, d = 32, 64
    k = torch.randn(blocks, bs, kv_heads, d, generator=gen).to(dtype)
    v = torch.randn(blocks, bs, kv_heads, d, generator=gen).to(dtype)
    perm = torch.randperm(blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in lens:
        tables.append(perm[used : used + -(-n // bs)])
        used += len(tables[-1])
    rows = sum(q_lens) + 3  # three padding rows past the last sub-request
    q = torch.randn(rows, heads, d, generator=gen).to(dtype)
    pos = [n - q for n, q in zip(lens, q_lens, strict=True)]
    meta = AttentionMetadata.build(q_lens, pos, tables, "cpu")
    return q, k, v, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)], ids=["gqa3", "mha", "mqa"])
def test_native_decode_equals_the_pytorch_path(monkeypatch, dtype, heads, kv_heads):
    lens = [1, 2, 31, 32, 33, 64, 200, 17, 900]
    q_lens = [1, 1, 1, 1, 20, 1, 1, 17, 1]  # two prompt pieces among the decodes
    q, k, v, meta = batch(lens, q_lens, heads, kv_heads, dtype, blocks=96)
    native = paged_attention_torch(q, k, v, meta, 0.125)
    monkeypatch.setenv("PENSIEVE_NATIVE_CPU", "0")
    cpu_native.module.cache_clear()
    try:
        assert cpu_native.module() is None
        q2, k2, v2, meta2 = batch(lens, q_lens, heads, kv_heads, dtype, blocks=96)
        ref = paged_attention_torch(q2, k2, v2, meta2, 0.125)
    finally:
        monkeypatch.undo()
        cpu_native.module.cache_clear()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(native.float(), ref.float(), rtol=tol, atol=tol)
    assert native[-3:].abs().max() == 0  # padding rows stay zero


def test_bad_inputs_are_refused():
    q, k, v, meta = batch([40], [1], 9, 3, torch.float32)
    m = cpu_native.module()
    out = torch.zeros_like(q)
    blocks, lens, rows = torch.zeros(1, 2, dtype=torch.long), torch.tensor([40]), torch.tensor([0])
    none = torch.empty(0)  # no sinks
    with pytest.raises(RuntimeError, match="dtype"):
        m.paged_decode(q.bfloat16(), k, v, blocks, lens, rows, 0.125, 0, none, out)
    with pytest.raises(RuntimeError, match="int64"):
        m.paged_decode(q, k, v, blocks.int(), lens, rows, 0.125, 0, none, out)
    with pytest.raises(RuntimeError, match="multiple"):
        m.paged_decode(
            q[:, :8].contiguous(), k, v, blocks, lens, rows, 0.125, 0, none, out[:, :8].contiguous()
        )
    with pytest.raises(RuntimeError, match="one per query head"):
        m.paged_decode(q, k, v, blocks, lens, rows, 0.125, 0, torch.zeros(3), out)
    with pytest.raises(RuntimeError, match="exceeds"):
        m.paged_decode(q, k, v, blocks, torch.tensor([65]), rows, 0.125, 0, none, out)
    with pytest.raises(RuntimeError, match="out of the pool"):
        m.paged_decode(q, k, v, blocks + 1000, lens, rows, 0.125, 0, none, out)
    assert not cpu_native.usable(q.half(), k.half())  # float16: the PyTorch path


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    # A process killed while it built the kernel leaves the loader's lock behind, and the
    # loader would wait on it forever; one younger than any build is another's build.
    lock = tmp_path / "lock"
    assert not cpu_native.clear_stale_lock(lock)  # none: nothing to do
    lock.touch()
    now = lock.stat().st_mtime
    assert not cpu_native.clear_stale_lock(lock, now=now + 60) and lock.exists()
    assert cpu_native.clear_stale_lock(lock, now=now + cpu_native.STALE_LOCK_S + 1)
    assert not lock.exists()
