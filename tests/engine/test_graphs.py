"""Decode graphs on the CPU: buckets, padding, and the padded buffers through the engine
(everything but the capture itself, which `tests/engine/test_gpu_engine.py` checks on a GPU)."""

from __future__ import annotations

import os

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams, Turn
from engine.batch import StepInputs, build
from engine.copies import CopyPlan
from engine.graphs import DecodeGraphs, bucket_of, bucket_sizes, is_decode_only, pad
from kernels import paged_attention, write_kv

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
CS = 4


def test_buckets():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(5) == [1, 2, 4, 8]
    assert bucket_sizes(256) == bucket_sizes(10_000) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    sizes = bucket_sizes(64)
    assert [bucket_of(n, sizes) for n in (1, 2, 3, 9, 64, 65)] == [1, 2, 4, 16, 64, None]


def test_decode_only():
    x = StepInputs(ids=[1, 2], starts=[3, 9], ends=[4, 10], tables=[[0], [1, 2, 3]], sample=[1])
    assert is_decode_only(x, CopyPlan())
    assert not is_decode_only(x, CopyPlan(swap_in=[(0, 1)]))
    assert is_decode_only(x, CopyPlan(swap_out=[(0, 1)]))
    assert not is_decode_only(
        StepInputs(ids=[1, 2], starts=[0], ends=[2], tables=[[0]]), CopyPlan()
    )
    assert not is_decode_only(StepInputs(), CopyPlan())


def decode_step() -> StepInputs:
    return StepInputs(
        ids=[11, 12, 13],
        starts=[5, 0, 9],
        ends=[6, 1, 10],
        tables=[[3, 1], [2], [0, 4, 5]],
        sample=[0, 2],
    )


def test_pad_makes_inert_rows():
    b = pad(build(decode_step(), CS, width=6), 8)
    assert b.ids.tolist() == [11, 12, 13, 0, 0, 0, 0, 0]
    assert b.positions.tolist() == [5, 0, 9, 0, 0, 0, 0, 0]
    assert b.slots.tolist() == [1 * CS + 1, 2 * CS, 5 * CS + 1] + [-1] * 5
    assert b.query_start.tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 3]  # padded q_len 0
    assert b.query_pos.tolist() == [5, 0, 9, 0, 0, 0, 0, 0]
    assert b.tables.shape == (8, 6) and b.tables[3:].eq(0).all()
    assert b.rows.tolist() == [0, 2]
    with pytest.raises(ValueError):
        pad(build(decode_step(), CS), 2)
    with pytest.raises(ValueError):
        pad(build(StepInputs(ids=[1, 2], starts=[0], ends=[2], tables=[[0]]), CS), 4)


@pytest.mark.parametrize(
    "backend",
    [
        "torch",
        pytest.param(
            "triton", marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
        ),
    ],
)
def test_padded_rows_write_nothing_and_leave_real_rows_alone(backend):
    g = torch.Generator().manual_seed(0)
    blocks, heads, kv_heads, dim = 6, 4, 2, 16
    k_cache = torch.randn(blocks, CS, kv_heads, dim, generator=g)
    v_cache = torch.randn(blocks, CS, kv_heads, dim, generator=g)
    b = build(decode_step(), CS)
    padded = pad(build(decode_step(), CS, width=8), 8)
    q = torch.randn(8, heads, dim, generator=g)
    k = torch.randn(8, kv_heads, dim, generator=g)
    v = torch.randn(8, kv_heads, dim, generator=g)

    kc, vc = k_cache.clone(), v_cache.clone()
    write_kv(kc, vc, k[:3], v[:3], b.slots, backend=backend)
    want = paged_attention(q[:3], kc, vc, b.meta, 0.25, backend=backend)

    kp, vp = k_cache.clone(), v_cache.clone()
    write_kv(kp, vp, k, v, padded.slots, backend=backend)
    got = paged_attention(q, kp, vp, padded.meta, 0.25, backend=backend)
    assert torch.equal(kp, kc) and torch.equal(vp, vc)  # padded rows wrote nothing
    torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)


PROMPTS = [list(range(10, 10 + n)) for n in (5, 37, 64, 21, 9)]


def run_turns(engine: Engine, turns: int = 3) -> list[list[list[int]]]:
    out = []
    for t in range(turns):
        batch = [
            Turn(f"c{i}", [p[(t * 5) % len(p)]] + p, SamplingParams(max_tokens=10))
            for i, p in enumerate(PROMPTS)
        ]
        batch.append(  # a sampled turn: its seeded generator sits outside the graph
            Turn("hot", [7, 8, 9 + t], SamplingParams(max_tokens=10, temperature=1.0, seed=5))
        )
        out.append([r.token_ids for r in engine.run(batch)])
    return out


def make(**kw) -> Engine:
    return Engine(
        EngineConfig(
            model="dummy:tiny", device="cpu", gpu_cache_chunks=14, cpu_cache_chunks=40, **kw
        )
    )


def test_engine_with_padded_decode_buffers_equals_eager():
    """The bucket buffers (capture off) through the engine: the same tokens as without them,
    across turns with swap-outs and swap-ins (those steps run eagerly)."""
    eager = run_turns(make())
    engine = make()
    assert engine.runner.graphs is None  # graphs are CUDA-only
    r = engine.runner
    r.graphs = DecodeGraphs(
        r.model,
        r.pool,
        r.backend,
        bucket_sizes(8),
        width=16,
        vocab=engine.args.vocab_size,
        capture=False,
    )
    r.graphs.capture()  # warm-up only: an all-padding batch writes no KV
    assert run_turns(engine) == eager
    assert r.graphs.replays > 0
    counters = engine.snapshot().counters
    assert counters.swapped_in_tokens > 0 or counters.recomputed_tokens > 0
