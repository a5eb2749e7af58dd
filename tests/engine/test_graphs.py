"""Step graphs on the CPU: buckets, padding (decode and mixed steps), and the padded buffers
through the engine (everything but the capture itself, which `tests/engine/test_gpu_engine.py`
checks on a GPU)."""

from __future__ import annotations

import os

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams, Turn
from engine.batch import StepInputs, build
from engine.copies import CopyPlan
from engine.graphs import (
    Bucket,
    StepGraphs,
    bucket_for,
    bucket_of,
    bucket_sizes,
    buckets,
    graphable,
    is_decode_only,
    pad,
)
from kernels import paged_attention, write_kv

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
CS = 4


def test_buckets():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(5) == [1, 2, 4, 8]
    assert bucket_sizes(256) == bucket_sizes(10_000) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    sizes = bucket_sizes(64)
    assert [bucket_of(n, sizes) for n in (1, 2, 3, 9, 64, 65)] == [1, 2, 4, 16, 64, None]


def test_mixed_buckets_double_past_the_decode_ones():
    assert buckets(4, 0) == [Bucket(1, 1), Bucket(2, 2), Bucket(4, 4)]
    sizes = buckets(4, 20)
    assert sizes[3:] == [Bucket(8, 4), Bucket(16, 4), Bucket(32, 4)]
    assert bucket_for(3, 3, sizes) == Bucket(4, 4)  # decode
    assert bucket_for(3, 1, sizes) == Bucket(8, 4)  # a prompt piece: a mixed bucket only
    assert bucket_for(3, 1, buckets(4, 0)) is None  # decode buckets only: it runs eagerly
    assert bucket_for(9, 2, sizes) == Bucket(16, 4)
    assert bucket_for(9, 5, sizes) is None  # more turns than any bucket holds
    assert bucket_for(33, 1, sizes) is None


def test_decode_only():
    x = StepInputs(ids=[1, 2], starts=[3, 9], ends=[4, 10], tables=[[0], [1, 2, 3]], sample=[1])
    assert is_decode_only(x, CopyPlan())
    assert not is_decode_only(x, CopyPlan(swap_in=[(0, 1)]))
    assert is_decode_only(x, CopyPlan(swap_out=[(0, 1)]))
    assert not is_decode_only(
        StepInputs(ids=[1, 2], starts=[0], ends=[2], tables=[[0]]), CopyPlan()
    )
    assert not is_decode_only(StepInputs(), CopyPlan())
    prompt = StepInputs(ids=[1, 2], starts=[0], ends=[2], tables=[[0]])
    assert graphable(prompt, CopyPlan()) and not graphable(prompt, CopyPlan(load=[([], 0)]))


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
    with pytest.raises(ValueError):  # 5 positions in a bucket of 4
        pad(build(StepInputs(ids=[1] * 5, starts=[0], ends=[5], tables=[[0, 1]]), CS), 4)


def mixed_step() -> StepInputs:
    """A 3-token prompt piece between two decodes."""
    return StepInputs(
        ids=[11, 21, 22, 23, 13],
        starts=[5, 2, 9],
        ends=[6, 5, 10],
        tables=[[3, 1], [2], [0, 4, 5]],
        sample=[0, 1, 2],
    )


def test_pad_makes_inert_positions_and_turns_of_a_mixed_step():
    b = pad(build(mixed_step(), CS, width=6), Bucket(8, 4))
    assert b.ids.tolist() == [11, 21, 22, 23, 13, 0, 0, 0]
    assert b.positions.tolist() == [5, 2, 3, 4, 9, 0, 0, 0]
    assert b.slots.tolist()[5:] == [-1] * 3
    assert b.query_start.tolist() == [0, 1, 4, 5, 5]  # the padded turn: q_len 0
    assert b.query_pos.tolist() == [5, 2, 9, 0]
    assert b.tables.shape == (4, 6) and b.tables[3].eq(0).all()
    assert b.rows.tolist() == [0, 3, 4]
    with pytest.raises(ValueError):
        pad(build(mixed_step(), CS), Bucket(4, 4))  # 5 positions
    with pytest.raises(ValueError):
        pad(build(mixed_step(), CS), Bucket(8, 2))  # 3 turns


@pytest.mark.parametrize("step", ["decode", "mixed"])
@pytest.mark.parametrize(
    "backend",
    [
        "torch",
        pytest.param(
            "triton", marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
        ),
    ],
)
def test_padded_rows_write_nothing_and_leave_real_rows_alone(step, backend):
    g = torch.Generator().manual_seed(0)
    blocks, heads, kv_heads, dim = 6, 4, 2, 16
    k_cache = torch.randn(blocks, CS, kv_heads, dim, generator=g)
    v_cache = torch.randn(blocks, CS, kv_heads, dim, generator=g)
    x = decode_step() if step == "decode" else mixed_step()
    b = build(x, CS)
    padded = pad(build(x, CS, width=8), 8 if step == "decode" else Bucket(8, 4))
    n = b.ids.numel()
    q = torch.randn(8, heads, dim, generator=g)
    k = torch.randn(8, kv_heads, dim, generator=g)
    v = torch.randn(8, kv_heads, dim, generator=g)

    kc, vc = k_cache.clone(), v_cache.clone()
    write_kv(kc, vc, k[:n], v[:n], b.slots, backend=backend)
    want = paged_attention(q[:n], kc, vc, b.meta, 0.25, backend=backend)

    kp, vp = k_cache.clone(), v_cache.clone()
    write_kv(kp, vp, k, v, padded.slots, backend=backend)
    got = paged_attention(q, kp, vp, padded.meta, 0.25, backend=backend)
    assert torch.equal(kp, kc) and torch.equal(vp, vc)  # padded rows wrote nothing
    torch.testing.assert_close(got[:n], want, rtol=1e-5, atol=1e-5)


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


@pytest.mark.parametrize("ahead", [False, True], ids=["in-step", "ahead"])
@pytest.mark.parametrize("mixed_tokens", [0, 256])
def test_engine_with_padded_buffers_equals_eager(mixed_tokens, ahead):
    """The bucket buffers (capture off) through the engine: the same tokens as without them,
    across turns with swap-outs and swap-ins (those steps run eagerly); with mixed buckets,
    the prompt steps run through them too. `ahead`: the lagged step loop, whose placeholder
    ids are filled in the buffers."""
    eager = run_turns(make())
    engine = make(async_steps=ahead)
    assert engine.runner.graphs is None  # graphs are CUDA-only
    r = engine.runner
    r.graphs = StepGraphs(
        r.model,
        r.pool,
        r.backend,
        buckets(8, mixed_tokens),
        width=16,
        vocab=engine.args.vocab_size,
        capture=False,
    )
    r.graphs.capture()  # warm-up only: an all-padding batch writes no KV
    assert run_turns(engine) == eager
    assert r.graphs.replays > 0
    assert (r.graphs.mixed_replays > 0) == (mixed_tokens > 0)
    counters = engine.snapshot().counters
    assert counters.swapped_in_tokens > 0 or counters.recomputed_tokens > 0
