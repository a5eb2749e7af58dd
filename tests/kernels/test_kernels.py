"""Paged attention kernels against the PyTorch reference, and the reference against a naive oracle.

The Triton kernels run on CPU tensors under TRITON_INTERPRET=1 (shapes kept small: the
interpreter is slow); the `gpu` tests repeat the comparisons on CUDA at realistic sizes.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

from kernels import AttentionMetadata, paged_attention, write_kv
from kernels.reference import paged_attention_torch, write_kv_torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
needs_triton_cpu = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 on CPU")
gpu = pytest.mark.gpu
# Compiled kernels only: the interpreter would crawl through realistic sizes.
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or INTERPRET, reason="needs CUDA without TRITON_INTERPRET"
)

# Relative error (max |diff| / max |ref|) tolerated per dtype.
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


# ---------------------------------------------------------------- batches


def make_case(
    subs: list[tuple[int, int] | tuple[int, int, int]],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype=torch.float32,
    device="cpu",
    spare_blocks: int = 3,
    seed: int = 0,
    pool: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_ids: list[int] | None = None,
):
    """A batch of sub-requests (q_len, query_pos[, table]) over a shuffled paged pool.

    Sub-requests naming the same `table` index share one block table (a recomputed prefix and
    the new prompt of the same turn); the table covers the longest context that uses it.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    tables: dict[int, int] = {}  # table index -> context length it must cover
    for i, sub in enumerate(subs):
        q_len, pos = sub[0], sub[1]
        t = sub[2] if len(sub) == 3 else 1000 + i
        tables[t] = max(tables.get(t, 0), pos + q_len)
    need = {t: -(-ctx // block_size) for t, ctx in tables.items()}
    total = sum(need.values())
    if block_ids is None:
        block_ids = list(range(total + spare_blocks))
    num_blocks = max(block_ids) + 1
    rng.shuffle(block_ids)
    blocks: dict[int, list[int]] = {}
    for t, n in need.items():
        blocks[t], block_ids = block_ids[:n], block_ids[n:]
    if pool is None:
        shape = (num_blocks, block_size, kv_heads, head_dim)
        k_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
        v_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    else:
        k_cache, v_cache = pool
        for t in blocks.values():  # only the used blocks get values: the pool may be huge
            for b in t:
                k_cache[b] = torch.randn(k_cache.shape[1:], generator=gen).to(dtype)
                v_cache[b] = torch.randn(v_cache.shape[1:], generator=gen).to(dtype)
    q_lens = [s[0] for s in subs]
    positions = [s[1] for s in subs]
    table_of = [s[2] if len(s) == 3 else 1000 + i for i, s in enumerate(subs)]
    meta = AttentionMetadata.build(q_lens, positions, [blocks[t] for t in table_of], device)
    q = torch.randn((sum(q_lens), heads, head_dim), generator=gen).to(dtype).to(device)
    return q, k_cache, v_cache, meta


def naive_attention(q, k_cache, v_cache, meta, scale, window: int | None = None, sinks=None):
    """The oracle for the oracle: position by position, float64, explicit causal softmax; with
    a sliding `window`, the query at i sees the key at j iff 0 <= i - j < window; with
    `sinks` (one logit per query head), each joins its head's softmax, its share dropped."""
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    starts = meta.query_start.tolist()
    for s, pos in enumerate(meta.query_pos.tolist()):
        table = meta.block_tables[s].tolist()
        for i in range(starts[s + 1] - starts[s]):
            row = starts[s] + i
            n_keys = pos + i + 1
            first = 0 if window is None else max(0, n_keys - window)
            idx = [(table[p // block_size], p % block_size) for p in range(first, n_keys)]
            k = torch.stack([k_cache[b, o] for b, o in idx]).double()  # [n, kvh, d]
            v = torch.stack([v_cache[b, o] for b, o in idx]).double()
            for h in range(q.shape[1]):
                scores = k[:, h // group] @ q[row, h].double() * scale
                if sinks is None:
                    out[row, h] = torch.softmax(scores, 0) @ v[:, h // group]
                else:
                    both = torch.cat([scores, sinks[h].double().view(1)])
                    out[row, h] = torch.softmax(both, 0)[:-1] @ v[:, h // group]
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def check(out, q, k_cache, v_cache, meta, scale):
    assert not torch.isnan(out).any(), "some output rows were never written"
    ref = paged_attention_torch(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    err = rel_err(out.float(), ref)
    assert err < TOL[q.dtype], f"relative error {err:.2e} over {TOL[q.dtype]:.0e}"


def run_triton(q, k_cache, v_cache, meta, scale, num_segs=None):
    from kernels.triton_attention import paged_attention_triton

    out = torch.full_like(q, float("nan"))
    return paged_attention_triton(q, k_cache, v_cache, meta, scale, num_segs=num_segs, out=out)


# A mixed batch: decodes, a prompt crossing blocks, and a dropped-prefix recompute (pos 0)
# sharing its block table with the new prompt of the same turn.
MIXED = [(1, 37), (9, 0), (1, 0), (6, 21, 7), (21, 0, 7), (1, 70), (3, 5)]


# ---------------------------------------------------------------- reference


@pytest.mark.parametrize(
    "heads,kv_heads,block_size",
    [(4, 4, 16), (6, 2, 16), (8, 1, 32)],
)
def test_reference_matches_naive(heads, kv_heads, block_size):
    q, k, v, meta = make_case(
        MIXED, heads=heads, kv_heads=kv_heads, head_dim=32, block_size=block_size
    )
    scale = 1 / math.sqrt(32)
    out = paged_attention_torch(q, k, v, meta, scale)
    assert rel_err(out, naive_attention(q, k, v, meta, scale)) < 1e-5


def test_reference_reuses_plan_and_zeroes_padding_rows():
    q, k, v, meta = make_case(MIXED, heads=2, kv_heads=2, head_dim=16, block_size=16)
    padded = torch.cat([q, torch.randn(3, 2, 16)])
    out = paged_attention(padded, k, v, meta, 0.25, backend="torch")
    assert len(meta.derived) == 1
    plan = next(iter(meta.derived.values()))
    again = paged_attention(padded, k, v, meta, 0.25, backend="torch")
    assert next(iter(meta.derived.values())) is plan
    assert torch.equal(out, again)
    assert torch.all(out[q.shape[0] :] == 0)


def test_backend_choice():
    from kernels import pick_backend

    assert pick_backend("cpu") == "torch"
    assert pick_backend("cuda:0") == "triton"
    with pytest.raises(ValueError):
        pick_backend("cpu", "cuda")


# ---------------------------------------------------------------- Triton, interpreter


@needs_triton_cpu
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [
        (2, 2, 64, 16),  # MHA
        (3, 1, 64, 32),  # GQA 3 (group padded to 4)
        (8, 2, 64, 64),  # GQA 4
        (8, 1, 128, 16),  # GQA 8, head dim 128
        (9, 3, 64, 16),  # the bundled model's shape: 9 heads over 3 KV heads, dim 64
        (4, 2, 80, 32),  # a head dim that is not a power of two (padded lanes masked)
    ],
)
def test_triton_matches_reference(heads, kv_heads, head_dim, block_size):
    q, k, v, meta = make_case(
        MIXED, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size
    )
    scale = 1 / math.sqrt(head_dim)
    check(run_triton(q, k, v, meta, scale), q, k, v, meta, scale)


@needs_triton_cpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_half_precision(dtype):
    q, k, v, meta = make_case(
        MIXED, heads=4, kv_heads=2, head_dim=64, block_size=16, dtype=dtype, seed=1
    )
    check(run_triton(q, k, v, meta, 0.125), q, k, v, meta, 0.125)


@needs_triton_cpu
def test_triton_long_prompt_many_query_tiles():
    # 70 queries at position 40: several query tiles, the diagonal crossing key tiles.
    subs = [(70, 40), (1, 100), (2, 3)]
    q, k, v, meta = make_case(subs, heads=4, kv_heads=1, head_dim=64, block_size=16, seed=2)
    check(run_triton(q, k, v, meta, 0.125), q, k, v, meta, 0.125)


@needs_triton_cpu
@pytest.mark.parametrize("num_segs", [2, 8])
def test_triton_split_kv(num_segs):
    # Decode rows and short prompts alike must merge right, including segments with no keys.
    subs = [(1, 150), (1, 3), (5, 90), (4, 0)]
    q, k, v, meta = make_case(subs, heads=4, kv_heads=2, head_dim=64, block_size=16, seed=3)
    check(run_triton(q, k, v, meta, 0.125, num_segs=num_segs), q, k, v, meta, 0.125)


@needs_triton_cpu
def test_triton_padding_and_empty_subrequests():
    # An empty sub-request in the middle; rows past the last sub-request stay untouched.
    q, k, v, meta = make_case(
        [(2, 5), (0, 9), (1, 17)], heads=2, kv_heads=1, head_dim=64, block_size=16, seed=4
    )
    padded = torch.cat([q, torch.zeros(2, 2, 64)])
    out = run_triton(padded, k, v, meta, 0.125)
    check(out[:3], q, k, v, meta, 0.125)
    assert torch.isnan(out[3:]).all()


@needs_triton_cpu
def test_triton_strided_query_from_fused_projection():
    # The model slices q out of a fused qkv projection: rows are not contiguous.
    q, k, v, meta = make_case(MIXED, heads=4, kv_heads=2, head_dim=64, block_size=16, seed=6)
    qkv = torch.cat([q, torch.randn(q.shape[0], 4, 64)], dim=1)
    strided = qkv[:, :4]
    assert not strided.is_contiguous()
    out = run_triton(strided, k, v, meta, 0.125)
    assert torch.equal(
        paged_attention(strided, k, v, meta, 0.125, backend="torch"),
        paged_attention(q, k, v, meta, 0.125, backend="torch"),
    )
    check(out, q, k, v, meta, 0.125)


@needs_triton_cpu
def test_triton_pool_offsets_past_32_bits():
    # Blocks past 2**31 elements into the pool. torch.empty only reserves address space: just
    # the touched blocks cost memory, so a ~4 GiB fp16 pool stays cheap.
    block_size, kv_heads, head_dim = 16, 1, 64
    per_block = block_size * kv_heads * head_dim
    num_blocks = (2**31) // per_block + 64
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.empty(shape, dtype=torch.float16)
    v = torch.empty(shape, dtype=torch.float16)
    ids = [0, 1] + list(range(num_blocks - 12, num_blocks))
    q, k, v, meta = make_case(
        [(1, 60), (3, 40)],
        heads=2,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.float16,
        pool=(k, v),
        block_ids=ids,
        seed=5,
    )
    assert int(meta.block_tables.max()) * k.stride(0) >= 2**31
    out = run_triton(q, k, v, meta, 0.125)
    assert not torch.isnan(out).any()
    used = sorted({b for b in meta.block_tables.flatten().tolist()})
    small_k, small_v = k[used].float(), v[used].float()
    remap = {b: i for i, b in enumerate(used)}
    small_meta = AttentionMetadata(
        meta.query_start,
        meta.query_pos,
        meta.block_tables.clone().apply_(lambda b: remap[b]),
    )
    ref = paged_attention_torch(q.float(), small_k, small_v, small_meta, 0.125)
    assert rel_err(out.float(), ref) < TOL[torch.float16]


@needs_triton_cpu
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_write_kv_triton_matches_torch(slot_dtype):
    num_blocks, block_size, kv_heads, head_dim = 6, 16, 3, 64
    shape = (num_blocks, block_size, kv_heads, head_dim)
    kc, vc = torch.randn(shape), torch.randn(shape)
    kc2, vc2 = kc.clone(), vc.clone()
    slots = torch.tensor([5, 17, -1, 95, 40, -1, 0], dtype=slot_dtype)
    k, v = torch.randn(7, kv_heads, head_dim), torch.randn(7, kv_heads, head_dim)
    write_kv(kc, vc, k, v, slots, backend="triton")
    write_kv_torch(kc2, vc2, k, v, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    flat = kc.view(-1, kv_heads, head_dim)
    assert torch.equal(flat[95], k[3]) and torch.equal(flat[0], k[6])


@needs_triton_cpu
def test_write_kv_triton_past_32_bits_and_casts():
    block_size, kv_heads, head_dim = 16, 2, 64
    num_blocks = (2**31) // (block_size * kv_heads * head_dim) + 4
    shape = (num_blocks, block_size, kv_heads, head_dim)
    kc = torch.empty(shape, dtype=torch.float16)
    vc = torch.empty(shape, dtype=torch.float16)
    slots = torch.tensor([(num_blocks - 1) * block_size + 3, 7], dtype=torch.int64)
    k, v = torch.randn(2, kv_heads, head_dim), torch.randn(2, kv_heads, head_dim)
    write_kv(kc, vc, k, v, slots, backend="triton")
    assert torch.equal(kc[num_blocks - 1, 3], k[0].half())
    assert torch.equal(vc[num_blocks - 1, 3], v[0].half())
    assert torch.equal(kc[0, 7], k[1].half())


def test_write_kv_torch_skips_padding():
    kc, vc = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    k, v = torch.ones(3, 1, 8), torch.full((3, 1, 8), 2.0)
    write_kv(kc, vc, k, v, torch.tensor([-1, 5, -1]), backend="torch")
    assert kc.sum() == 8 and vc.sum() == 16 and kc[1, 1].eq(1).all()


# ---------------------------------------------------------------- Triton, GPU


def random_subs(rng: random.Random, n: int, max_ctx: int) -> list[tuple]:
    """Decodes, prompts and recompute pairs sharing a table, at random lengths."""
    subs: list[tuple] = []
    for i in range(n):
        kind = rng.random()
        if kind < 0.5:
            subs.append((1, rng.randint(0, max_ctx)))
        elif kind < 0.8:
            subs.append((rng.randint(2, 300), rng.randint(0, max_ctx)))
        else:
            dropped = rng.randint(1, max_ctx // 2)
            subs.append((dropped, 0, i))
            subs.append((rng.randint(1, 200), dropped, i))
    return subs


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(40, 40, 128, 32), (32, 8, 128, 16), (24, 8, 64, 64), (9, 3, 64, 32), (32, 4, 128, 32)],
)
def test_gpu_triton_matches_reference(dtype, heads, kv_heads, head_dim, block_size):
    rng = random.Random(heads * block_size)
    subs = random_subs(rng, 24, 3000)
    q, k, v, meta = make_case(
        subs,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device="cuda",
        spare_blocks=50,
    )
    scale = 1 / math.sqrt(head_dim)
    check(run_triton(q, k, v, meta, scale), q, k, v, meta, scale)
    check(run_triton(q, k, v, meta, scale, num_segs=4), q, k, v, meta, scale)
    assert torch.equal(paged_attention(q, k, v, meta, scale), paged_attention(q, k, v, meta, scale))


@gpu
@needs_cuda
@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (40, 4)])
@pytest.mark.parametrize("batch,max_ctx", [(1, 16000), (8, 8000), (64, 4000), (256, 1000)])
def test_gpu_decode_batch(batch, max_ctx, heads, kv_heads):
    # Sized for the fp32 reference, which expands the KV heads in memory. Small batches of
    # group 4 and 10 take the split path.
    rng = random.Random(batch)
    subs = [(1, rng.randint(1, max_ctx)) for _ in range(batch)]
    q, k, v, meta = make_case(
        subs,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=128,
        block_size=32,
        dtype=torch.bfloat16,
        device="cuda",
    )
    check(run_triton(q, k, v, meta, 0.088), q, k, v, meta, 0.088)


@gpu
@needs_cuda
def test_gpu_split_decode_in_a_cuda_graph():
    # The plan and its segment buffers are made at the first (eager) call and reused by the
    # captured ones: a graph-captured decode step replays to the eager result.
    from kernels.triton_attention import paged_attention_triton

    subs = [(1, 3000), (1, 1200), (1, 40)]
    q, k, v, meta = make_case(
        subs, heads=40, kv_heads=4, head_dim=128, block_size=32, dtype=torch.float16, device="cuda"
    )
    eager = paged_attention_triton(q, k, v, meta, 0.088)
    assert triton_plan(meta).cfg.num_segs > 1
    out = torch.zeros_like(q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention_triton(q, k, v, meta, 0.088, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@gpu
@needs_cuda
def test_gpu_pool_offsets_past_32_bits():
    block_size, kv_heads, head_dim = 32, 8, 128
    num_blocks = (2**31) // (block_size * kv_heads * head_dim) + 256
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.zeros(shape, dtype=torch.float16, device="cuda")
    v = torch.zeros(shape, dtype=torch.float16, device="cuda")
    ids = list(range(num_blocks - 200, num_blocks))
    q, k, v, meta = make_case(
        [(1, 2000), (37, 900), (1, 5)],
        heads=32,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.float16,
        device="cuda",
        pool=(k, v),
        block_ids=ids,
    )
    check(run_triton(q, k, v, meta, 0.088), q, k, v, meta, 0.088)
    slots = torch.tensor([(num_blocks - 1) * block_size + 5, -1], device="cuda")
    new = torch.randn(2, kv_heads, head_dim, device="cuda", dtype=torch.float16)
    write_kv(k, v, new, new, slots)
    assert torch.equal(k[num_blocks - 1, 5], new[0]) and torch.equal(v[num_blocks - 1, 5], new[0])


@needs_triton_cpu
@pytest.mark.parametrize("seed", range(6))
def test_triton_random_batches(seed):
    rng = random.Random(seed)
    kv_heads = rng.choice([1, 2])
    group = rng.choice([1, 3, 4, 8])
    block_size = rng.choice([16, 32, 64])
    head_dim = rng.choice([64, 128])
    subs = random_subs(rng, 3, 150)
    subs = [(min(s[0], 40),) + tuple(s[1:]) for s in subs]  # small: the interpreter is slow
    q, k, v, meta = make_case(
        subs,
        heads=kv_heads * group,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        seed=seed,
    )
    scale = 1 / math.sqrt(head_dim)
    check(run_triton(q, k, v, meta, scale), q, k, v, meta, scale)


# ---------------------------------------------------------------- launch policy


def test_pick_config_splits_small_grids_only():
    from kernels.triton_attention import MIN_KEYS_PER_ROW, PROGRAMS_PER_SM, pick_config

    sms = 132
    # Decode, 8 sequences of a 40-head model over 4 KV heads (group 10): 32 programs alone.
    short = pick_config(8, 8, 4, 10, 128, 1056, sms)
    long = pick_config(8, 8, 4, 10, 128, 16416, sms)
    assert (short.block_m, short.block_q) == (16, 1)
    assert 1 < short.num_segs < long.num_segs
    for cfg, ctx in ((short, 1056), (long, 16416)):
        assert 32 * cfg.num_segs <= PROGRAMS_PER_SM * sms
        assert ctx >= MIN_KEYS_PER_ROW * cfg.block_m * cfg.num_segs
    assert pick_config(1, 1, 4, 10, 128, 16416, sms).num_segs > long.num_segs
    # Enough programs already: no split, no merge.
    assert pick_config(256, 256, 4, 10, 128, 4096, sms).num_segs == 1
    assert pick_config(8, 8, 40, 1, 128, 4096, sms).num_segs == 1
    assert pick_config(4096, 1, 8, 4, 128, 4096, sms).num_segs == 1
    # Short contexts are not split into slivers, nor 64-row tiles of 8-token queries at 1k
    # (their partials would cost a third of the K/V read); at 16k they are.
    assert pick_config(1, 1, 1, 8, 128, 64, sms).num_segs == 1
    assert pick_config(256, 32, 4, 10, 128, 1056, sms).num_segs == 1
    assert pick_config(256, 32, 4, 10, 128, 16416, sms).num_segs == 2


@pytest.mark.parametrize("group,block_q", [(1, 64), (3, 21), (5, 12), (8, 8), (10, 6), (64, 1)])
def test_pick_config_packs_query_heads_densely(group, block_q):
    from kernels.triton_attention import pick_config

    prompt = pick_config(512, 1, 2, group, 128, 512, 132)
    assert prompt.block_q == block_q
    assert prompt.block_m >= prompt.block_q * group > prompt.block_m - group
    decode = pick_config(4, 4, 2, group, 128, 512, 132)
    assert decode.block_m == max(16, 1 << (group - 1).bit_length())


# ---------------------------------------------------------------- Triton: GQA, decode, splits


def triton_plan(meta):
    plans = [p for k, p in meta.derived.items() if k[0] == "triton_plan"]
    assert len(plans) == 1, "one launch plan per step, reused by every layer"
    return plans[0]


@needs_triton_cpu
@pytest.mark.parametrize("group", [1, 3, 5, 8])
def test_triton_decode_long_contexts_split_by_policy(group):
    # Decode-only: a grid far smaller than the (interpreter's 4) SMs x 4, contexts of many key
    # tiles, so the policy splits them; one context is short enough to leave segments empty.
    subs = [(1, 700), (1, 333), (1, 20)]
    q, k, v, meta = make_case(
        subs, heads=group, kv_heads=1, head_dim=64, block_size=16, seed=10 + group
    )
    out = run_triton(q, k, v, meta, 0.125)
    assert triton_plan(meta).cfg.num_segs > 1
    check(out, q, k, v, meta, 0.125)
    # A second layer of the same step reuses the plan and its buffers, and agrees.
    again = run_triton(q, k, v, meta, 0.125)
    assert torch.equal(out, again)
    triton_plan(meta)


@needs_triton_cpu
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (10, 2), (16, 2)])
def test_triton_mixed_batch_gqa(heads, kv_heads):
    # Groups 3, 5 and 8 over a mixed batch (prompts, decodes, a recompute sharing a table).
    q, k, v, meta = make_case(
        MIXED, heads=heads, kv_heads=kv_heads, head_dim=64, block_size=16, seed=heads
    )
    check(run_triton(q, k, v, meta, 0.125), q, k, v, meta, 0.125)


@needs_triton_cpu
def test_triton_forced_launch_config():
    # The benchmark's override: another row packing, key tile and split on a mixed batch.
    from kernels.triton_attention import LaunchConfig

    subs = [(1, 200), (7, 30), (1, 5)]
    q, k, v, meta = make_case(subs, heads=6, kv_heads=2, head_dim=64, block_size=16, seed=11)
    cfg = LaunchConfig(block_m=32, block_q=10, tile_n=16, num_segs=4, num_warps=4, num_stages=2)
    from kernels.triton_attention import paged_attention_triton

    out = torch.full_like(q, float("nan"))
    paged_attention_triton(q, k, v, meta, 0.125, out=out, config=cfg)
    check(out, q, k, v, meta, 0.125)
    with pytest.raises(ValueError):
        bad = LaunchConfig(block_m=16, block_q=8, tile_n=16, num_segs=1, num_warps=4, num_stages=2)
        paged_attention_triton(
            q, k, v, AttentionMetadata.build([1], [0], [[0]], "cpu"), 1, config=bad
        )
