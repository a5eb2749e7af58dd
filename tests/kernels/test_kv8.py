"""8-bit KV cache (`kv_dtype` fp8 or int8, a float16 scale per token and KV head).

Kernels: a quantized write then paged attention, both backends (Triton under the
interpreter), against float attention on the unquantized K/V. Pool: capacity per byte and
swaps that carry the scales. Engine: the bundled model's divergence from the float32 KV on
the held-in equality prompts, and an 8-bit run through swaps and drops equal to one without;
on the same reference, the divergence of bfloat16 weights and KV on the CPU.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams, Turn
from engine.backends.base import memory_tiers
from engine.copies import CopyPlan
from engine.kv_pool import KVPool
from engine.model.shapes import DUMMY_SHAPES
from kernels import AttentionMetadata, cpu_native, write_kv
from kernels.quant import CODE_DTYPE, MIN_SCALE, SCALE_DTYPE, QuantizedKV, dequantize, quantize
from kernels.reference import paged_attention_torch
from tests.devices import fp8
from tests.engine.test_engine_equality import prompts
from tests.kernels.test_kernels import (
    MIXED,
    TOL,
    gpu,
    make_case,
    needs_cuda,
    needs_triton_cpu,
    random_subs,
    rel_err,
)

FMTS = ["fp8", "int8"]
# Attention output vs float attention on the unquantized K/V (max |diff| / max |ref|):
# measured at most 0.036 (fp8) and 0.014 (int8) on these cases; a scale off by 2x gives ~1.
QUANT_TOL = {"fp8": 0.06, "int8": 0.02}


def empty_pool(like: torch.Tensor, fmt: str) -> QuantizedKV:
    blocks, block_size, kv_heads, _ = like.shape
    return QuantizedKV(
        torch.zeros(like.shape, dtype=CODE_DTYPE[fmt], device=like.device),
        torch.zeros((blocks, block_size, kv_heads), dtype=SCALE_DTYPE, device=like.device),
        fmt,
    )


GPU_FMTS = [pytest.param("fp8", marks=fp8), "int8"]  # fp8 where the GPU converts it


# ---------------------------------------------------------------- quantizer


@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_error_is_within_half_a_step(fmt):
    gen = torch.Generator().manual_seed(0)
    # Tokens of very different magnitudes, heavy tails: each gets its own scale.
    x = torch.randn(64, 3, 64, generator=gen) ** 3 * torch.exp(
        2 * torch.randn(64, 3, 1, generator=gen)
    )
    x[0] = 0.0
    codes, scales = quantize(x, fmt)
    assert codes.dtype == CODE_DTYPE[fmt] and scales.dtype == SCALE_DTYPE
    assert scales.shape == x.shape[:-1]
    y = dequantize(codes, scales, fmt, torch.float32)
    s = scales.float().unsqueeze(-1)
    if fmt == "fp8":  # 3 mantissa bits: half an ulp is 1/16 of the value; subnormals 2**-10
        bound = torch.maximum(x.abs() / 16, s * 2.0**-10)
    else:
        bound = s / 2
    assert torch.all((y - x).abs() <= bound * 1.001 + 1e-30)
    assert torch.all(y[0] == 0) and torch.all(scales[0].float() == MIN_SCALE)


@needs_triton_cpu
@pytest.mark.parametrize("fmt", FMTS)
def test_write_kv_triton_quantizes_as_torch_bit_for_bit(fmt):
    gen = torch.Generator().manual_seed(1)
    shape = (6, 16, 3, 64)
    k = torch.randn(60, 3, 64, generator=gen) * 3
    v = torch.randn(60, 3, 64, generator=gen) ** 5  # many values in e4m3's subnormal range
    k[5] = 0.0
    slots = torch.randperm(96, generator=gen)[:60].to(torch.int32)
    slots[3] = -1  # padding: skipped
    pools = {
        be: (empty_pool(torch.empty(shape), fmt), empty_pool(torch.empty(shape), fmt))
        for be in ("torch", "triton")
    }
    for be, (kc, vc) in pools.items():
        write_kv(kc, vc, k, v, slots, backend=be)
    (k1, v1), (k2, v2) = pools["torch"], pools["triton"]
    for a, b in ((k1, k2), (v1, v2)):
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    assert int((k1.scales != 0).sum()) == 59 * 3  # every written token got its scales


# ---------------------------------------------------------------- attention


CASES = [
    # heads, kv_heads, head_dim, block_size, dtype
    (2, 2, 64, 16, torch.float32),  # MHA
    (9, 3, 64, 16, torch.float32),  # the bundled model's GQA shape
    (8, 1, 128, 32, torch.bfloat16),  # GQA 8, half precision
]


def quantized_case(
    fmt, heads, kv_heads, head_dim, block_size, dtype, backend, subs=MIXED, device="cpu"
):
    """A batch (mixed prefill/decode by default) whose pool is written through `write_kv` (8-bit)."""
    q, k, v, meta = make_case(
        subs,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
    )
    kq, vq = empty_pool(k, fmt), empty_pool(v, fmt)
    slots = torch.arange(k.shape[0] * block_size, device=device)
    write_kv(
        kq,
        vq,
        k.view(-1, kv_heads, head_dim),
        v.view(-1, kv_heads, head_dim),
        slots,
        backend=backend,
    )
    return q, k, v, kq, vq, meta


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("case", CASES)
def test_reference_attention_over_8bit_pool(fmt, case, monkeypatch):
    *shape, dtype = case
    q, k, v, kq, vq, meta = quantized_case(fmt, *shape, dtype, "torch")
    scale = 1 / math.sqrt(shape[2])
    out = paged_attention_torch(q, kq, vq, meta, scale)
    # The 8-bit pool reads exactly as its dequantized float copy through the same PyTorch
    # path (a float pool's decodes would otherwise take the native CPU kernel) ...
    deq = [dequantize(c.codes, c.scales, fmt, dtype) for c in (kq, vq)]
    with monkeypatch.context() as m:
        m.setattr(cpu_native, "usable", lambda q, k_cache: False)
        assert torch.equal(out, paged_attention_torch(q, *deq, meta, scale))
    # ... and stays close to attention over the unquantized K/V.
    ref = paged_attention_torch(q.float(), k.float(), v.float(), meta, scale)
    assert rel_err(out.float(), ref) < QUANT_TOL[fmt]


# The interpreter is slow (split-KV's merge runs a program per row and head): few cases.
TRITON_CASES = [
    ("fp8", (9, 3, 64, 16, torch.float32), None),  # the bundled model's GQA shape
    ("fp8", (4, 1, 64, 32, torch.bfloat16), None),  # GQA 4, half precision
    ("int8", (9, 3, 64, 16, torch.float32), None),
    ("int8", (2, 2, 64, 16, torch.float32), 2),  # MHA, split-KV and its merge
]


@needs_triton_cpu
@pytest.mark.parametrize("fmt,case,segs", TRITON_CASES)
def test_triton_attention_over_8bit_pool(fmt, case, segs):
    from kernels.triton_attention import paged_attention_triton

    *shape, dtype = case
    # Written by the torch backend: the Triton write is bit-identical (tested above) and
    # one interpreted program per token would dominate this test.
    q, k, v, kq, vq, meta = quantized_case(fmt, *shape, dtype, "torch")
    scale = 1 / math.sqrt(shape[2])
    out = paged_attention_triton(q, kq, vq, meta, scale, num_segs=segs)
    # The reference over the same pool, dequantized to q's dtype as both backends do ...
    deq = (dequantize(c.codes, c.scales, fmt, dtype).float() for c in (kq, vq))
    assert rel_err(out.float(), paged_attention_torch(q.float(), *deq, meta, scale)) < TOL[dtype]
    # ... and attention over the unquantized K/V.
    ref = paged_attention_torch(q.float(), k.float(), v.float(), meta, scale)
    assert rel_err(out.float(), ref) < QUANT_TOL[fmt]


@needs_triton_cpu
@pytest.mark.parametrize("fmt,heads", [("int8", 5), ("fp8", 8)])
def test_triton_8bit_decode_split_by_policy(fmt, heads):
    # Decode-only over long contexts, group 5 and 8 on one KV head: the policy splits the keys
    # and the segments dequantize their own tiles.
    from kernels.triton_attention import paged_attention_triton

    subs = [(1, 600), (1, 250)]
    q, k, v, kq, vq, meta = quantized_case(fmt, heads, 1, 64, 16, torch.float32, "torch", subs)
    out = paged_attention_triton(q, kq, vq, meta, 0.125)
    plans = [p for key, p in meta.derived.items() if key[0] == "triton_plan"]
    assert plans[0].cfg.num_segs > 1
    deq = (dequantize(c.codes, c.scales, fmt, torch.float32) for c in (kq, vq))
    assert rel_err(out, paged_attention_torch(q, *deq, meta, 0.125)) < TOL[torch.float32]
    ref = paged_attention_torch(q, k, v, meta, 0.125)
    assert rel_err(out, ref) < QUANT_TOL[fmt]


@gpu
@needs_cuda
@pytest.mark.parametrize("fmt", GPU_FMTS)
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,dtype",
    [
        (40, 10, 128, 32, torch.bfloat16),
        (32, 8, 128, 16, torch.float16),
        (9, 3, 64, 32, torch.float32),
    ],
)
def test_gpu_8bit_kernels_match_reference(fmt, heads, kv_heads, head_dim, block_size, dtype):
    """Compiled on CUDA at realistic sizes: the Triton write quantizes as the torch one, bit
    for bit, and attention over the 8-bit pool (prefill, decode, split-KV) matches the
    reference over its dequantized copy and stays near float attention."""
    subs = random_subs(random.Random(heads * block_size), 16, 3000)
    check_8bit_kernels(fmt, (heads, kv_heads, head_dim, block_size, dtype), subs, "cuda")


def check_8bit_kernels(fmt, shape, subs, device) -> None:
    from kernels.triton_attention import paged_attention_triton

    heads, kv_heads, head_dim, block_size, dtype = shape
    q, k, v, kq, vq, meta = quantized_case(fmt, *shape, "triton", subs, device=device)
    kt, vt = empty_pool(k, fmt), empty_pool(v, fmt)
    slots = torch.arange(k.shape[0] * block_size, device=device)
    flat = (x.view(-1, kv_heads, head_dim) for x in (k, v))
    write_kv(kt, vt, *flat, slots, backend="torch")
    for a, b in ((kq, kt), (vq, vt)):
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    scale = 1 / math.sqrt(head_dim)
    deq = [dequantize(c.codes, c.scales, fmt, dtype).float() for c in (kq, vq)]
    want = paged_attention_torch(q.float(), *deq, meta, scale)
    ref = paged_attention_torch(q.float(), k.float(), v.float(), meta, scale)
    for segs in (None, 4):
        out = paged_attention_triton(q, kq, vq, meta, scale, num_segs=segs).float()
        assert rel_err(out, want) < TOL[dtype]
        assert rel_err(out, ref) < QUANT_TOL[fmt]


def test_kernels_refuse_mixed_pools():
    q, k, v, meta = make_case([(1, 3)], heads=2, kv_heads=2, head_dim=16, block_size=16)
    with pytest.raises(ValueError):
        from kernels.triton_attention import paged_attention_triton

        paged_attention_triton(q, empty_pool(k, "fp8"), v, meta, 0.25)


# ---------------------------------------------------------------- pool


@pytest.mark.parametrize("model", ["tiny", "llama-2-13b-gqa10"])
def test_8bit_pool_holds_twice_the_blocks_per_byte(model):
    args = DUMMY_SHAPES[model]
    per16 = KVPool.bytes_per_block(args, 32, torch.bfloat16)
    for fmt in FMTS:
        per8 = KVPool.bytes_per_block(args, 32, torch.bfloat16, fmt)
        # codes: 1 byte per value; scales: 2 bytes per token and head, i.e. head_dim + 2 bytes
        assert per8 * args.head_dim * 2 == per16 * (args.head_dim + 2)
        ratio = per16 / per8
        assert 2 * 64 / 66 <= ratio < 2  # 1.94x at head_dim 64, 1.97x at 128
        # Sized from the same memory, the engine's pools follow bytes_per_block.
        gpu16, cpu16 = memory_tiers(per16, None, torch.device("cpu"))
        gpu8, cpu8 = memory_tiers(per8, None, torch.device("cpu"))
        assert gpu8 / gpu16 == pytest.approx(ratio, rel=0.01)
        assert cpu8 / cpu16 == pytest.approx(ratio, rel=0.01)


@pytest.mark.parametrize("kv_dtype", ["auto", *FMTS])
def test_bytes_per_block_is_what_the_tiers_take(kv_dtype):
    args = DUMMY_SHAPES["tiny"]
    per = KVPool.bytes_per_block(args, 32, torch.bfloat16, kv_dtype)
    pool = KVPool(args, 5, 3, 32, "cpu", torch.bfloat16, kv_dtype)
    scales = kv_dtype != "auto"
    assert pool.gpu.nbytes + (pool.gpu_scales.nbytes if scales else 0) == 5 * per
    assert pool.cpu.nbytes + (pool.cpu_scales.nbytes if scales else 0) == 3 * per


@pytest.mark.parametrize("fmt", FMTS)
def test_swaps_carry_the_scales(fmt):
    args = DUMMY_SHAPES["tiny"]
    pool = KVPool(
        args,
        gpu_blocks=8,
        cpu_blocks=8,
        block_size=4,
        device="cpu",
        dtype=torch.float32,
        kv_dtype=fmt,
    )
    x = torch.randn(args.n_layers * 8 * 4, args.n_kv_heads, args.head_dim)
    for i, (kc, vc) in enumerate(pool.layers):
        part = x.view(args.n_layers, -1, args.n_kv_heads, args.head_dim)[i]
        write_kv(kc, vc, part, -part, torch.arange(32), backend="torch")
    codes, scales = pool.gpu.clone(), pool.gpu_scales.clone()
    pool.begin_step(CopyPlan(swap_out=[(1, 6), (2, 7), (5, 0)]))
    pool.gpu.zero_()
    pool.gpu_scales.zero_()
    pool.begin_step(CopyPlan(swap_in=[(6, 3), (7, 4), (0, 0)]))
    for layer in range(args.n_layers):
        pool.before_attention(layer)
    pool.end_step(CopyPlan())
    for dst, src in ((3, 1), (4, 2), (0, 5)):
        assert torch.equal(pool.gpu[:, :, dst], codes[:, :, src])
        assert torch.equal(pool.gpu_scales[:, :, dst], scales[:, :, src])


def test_kv_dtype_is_validated_and_a_server_flag():
    from app.cli import _settings, parser

    with pytest.raises(ValueError, match="kv_dtype"):
        EngineConfig(kv_dtype="fp16").validate()
    args = parser().parse_args(["serve", "--kv-dtype", "fp8"])
    assert _settings(args).engine_config().kv_dtype == "fp8"
    with pytest.raises(ValueError):  # pydantic's ValidationError is a ValueError
        _settings(parser().parse_args(["serve", "--kv-dtype", "e5m2"]))


def test_serve_picks_bfloat16_where_the_cpu_computes_it(caplog):
    """`pensieve serve` on a CPU with native bfloat16 serves it (the dtype whose divergence
    from float32 the test below bounds); elsewhere float32; a given --dtype is kept."""
    from app.cli import _settings, _with_serving_dtype, parser

    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    with caplog.at_level("INFO"):
        picked = _with_serving_dtype(_settings(parser().parse_args(["serve", "--device", "cpu"])))
    assert picked.dtype == ("bfloat16" if native else "float32")
    assert picked.engine_config().dtype == picked.dtype
    assert f"dtype {picked.dtype}: " in caplog.text
    given = _settings(parser().parse_args(["serve", "--device", "cpu", "--dtype", "float32"]))
    assert _with_serving_dtype(given).dtype == "float32"


# ---------------------------------------------------------------- engine

BUNDLED = "smollm2-135m-instruct"
# Divergence from the float32 KV (the CPU default, equal to transformers) on the held-in
# equality prompts (4 conversations x 3 turns, 16 tokens a reply), float32 model. Measured:
# fp8: 10 of 12 replies identical (the others first differ at tokens 0 and 9), teacher-forced
#      max logit error 3.65 (logits span about +-36), 97.0% of reply tokens the same argmax;
# int8: 12 of 12 identical, max logit error 1.19, 100%.
# A broken quantizer fails these: scales half as large (clipping) give a logit error of 29
# and 3 identical replies; e5m2 codes in place of e4m3 7.4; int8 truncating, not rounding, 3.2.
BOUNDS = {  # fmt: (identical replies of 12, max logit error, share of reply tokens agreeing)
    "fp8": (9, 5.0, 0.93),
    "int8": (11, 2.0, 0.98),
}


def logits_over(engine: Engine, tokens: list[int], kv_dtype: str) -> torch.Tensor:
    """Logits at every position of `tokens` read through a fresh pool of `kv_dtype`. With a
    scale per token a token's codes do not depend on the batch that wrote it, so these are
    the logits a served run sees while its tokens equal these (teacher forcing)."""
    cs = engine.config.chunk_size
    n = -(-len(tokens) // cs)
    pool = KVPool(engine.args, n, 0, cs, engine.device, engine.dtype, kv_dtype)
    meta = AttentionMetadata.build([len(tokens)], [0], [list(range(n))], engine.device)
    pos = torch.arange(len(tokens))
    return engine.model(
        torch.tensor(tokens), pos, pool.layers, meta, pos, pos, backend=engine.attention
    )


def serve(engine: Engine, plan: list[list[list[int]]], max_tokens: int = 16, ignore_eos=False):
    """Each conversation's turns in order, all conversations at once; replies [conv][turn]."""
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    replies: list[list[list[int]]] = [[] for _ in plan]
    for t in range(len(plan[0])):
        results = engine.run([Turn(f"c{i}", turns[t], sp) for i, turns in enumerate(plan)])
        for i, r in enumerate(results):
            replies[i].append(r.token_ids)
    engine.cache.check()
    return replies


@pytest.fixture(scope="module")
def reference():
    """The bundled model with float32 KV on the held-in prompts: streams and reply spans."""
    engine = Engine(EngineConfig(model=BUNDLED, device="cpu", gpu_cache_chunks=64))
    plan = prompts(engine, 4, 3, seed=0)
    replies = serve(engine, plan)
    streams, spans = [], []
    for turns, outs in zip(plan, replies, strict=True):
        stream: list[int] = []
        for prompt, out in zip(turns, outs, strict=True):
            stream += prompt
            spans.append((len(streams), len(stream), len(stream) + len(out)))
            stream += out
        streams.append(stream)
    ref_logits = [logits_over(engine, stream, "auto") for stream in streams]
    return engine, plan, streams, spans, ref_logits


@pytest.mark.parametrize("fmt", FMTS)
def test_bundled_model_divergence_from_float_kv(reference, fmt):
    engine, _, streams, spans, ref_logits = reference
    logits = [logits_over(engine, stream, fmt) for stream in streams]
    err = max((q - r).abs().max().item() for r, q in zip(ref_logits, logits, strict=True))
    identical, agree, total, firsts = 0, 0, 0, []
    for conv, start, end in spans:
        pred = logits[conv].argmax(-1)
        # the token at p is the greedy pick of the logits at p - 1
        same = [int(pred[p - 1]) == streams[conv][p] for p in range(start, end)]
        firsts.append(same.index(False) if False in same else None)
        identical += all(same)
        agree += sum(same)
        total += len(same)
    min_identical, max_err, min_agree = BOUNDS[fmt]
    print(
        f"{fmt}: first differing token per reply {firsts}, max logit error {err:.2f}, "
        f"agreement {agree / total:.3f}"
    )
    assert err < max_err
    assert identical >= min_identical, firsts
    assert agree / total >= min_agree


# bfloat16 weights and KV on the CPU (`dtype="bfloat16"`, packed for oneDNN where the CPU has
# native bfloat16) against the float32 default, measured the same way: 12 of 12 replies
# identical, max logit error 1.87, 100% of reply tokens the same argmax; served, all 12
# replies equal the float32 ones.
BF16_BOUNDS = (11, 3.0, 0.98)


def test_bundled_model_divergence_of_bfloat16_weights(reference):
    engine, plan, streams, spans, ref_logits = reference
    bf16 = Engine(EngineConfig(model=BUNDLED, device="cpu", gpu_cache_chunks=64, dtype="bfloat16"))
    logits = [logits_over(bf16, stream, "auto") for stream in streams]
    err = max((q - r).abs().max().item() for r, q in zip(ref_logits, logits, strict=True))
    identical, agree, total = 0, 0, 0
    for conv, start, end in spans:
        pred = logits[conv].argmax(-1)
        same = [int(pred[p - 1]) == streams[conv][p] for p in range(start, end)]
        identical += all(same)
        agree += sum(same)
        total += len(same)
    min_identical, max_err, min_agree = BF16_BOUNDS
    assert err < max_err and identical >= min_identical and agree / total >= min_agree
    assert err > 0  # it did compute in bfloat16
    served = serve(bf16, plan)
    replies = [r for s in served for r in s]
    assert sum(r == streams[c][a:b] for (c, a, b), r in zip(spans, replies, strict=True)) >= 6
    # Served batches have other shapes than teacher forcing, and bfloat16 sums in another order
    # on each CPU's kernels (12 of 12 replies equal on an AVX512-BF16 EPYC, 9 of 12 on another
    # CPU), so a reply may part from the float32 one; it may only do so at a near tie, where
    # float32's own top two logits lie within bfloat16's error. Past the first parting the
    # conversation's context differs, so only the first is checked.
    parted: set[int] = set()
    for (conv, start, end), reply in zip(spans, replies, strict=True):
        want = streams[conv][start:end]
        if conv in parted or reply == want:
            continue
        parted.add(conv)
        i = next((i for i, (a, b) in enumerate(zip(reply, want, strict=False)) if a != b), None)
        if i is not None:  # (else one reply stopped earlier: a parting at the end token)
            row = ref_logits[conv][start + i - 1]
            assert row[want[i]] - row[reply[i]] < max_err, (conv, start + i)


def test_fp8_served_matches_its_teacher_forced_greedy(reference):
    """The engine's fp8 decode path picks what teacher forcing through an fp8 pool predicts,
    up to the first token where the float32 KV run picked otherwise."""
    engine, plan, streams, spans, _ = reference
    fp8 = Engine(EngineConfig(model=BUNDLED, device="cpu", gpu_cache_chunks=64, kv_dtype="fp8"))
    served = serve(fp8, [turns[:1] for turns in plan])  # first turns: contexts equal so far
    for conv, turns in enumerate(served):
        _, start, end = next(s for s in spans if s[0] == conv)
        pred = logits_over(engine, streams[conv], "fp8").argmax(-1)
        want = []
        for p in range(start, end):
            want.append(int(pred[p - 1]))
            if want[-1] != streams[conv][p]:
                break  # past here the fp8 run's context differs from the stream
        assert turns[0][: len(want)] == want


def test_8bit_kv_through_swaps_and_drops_equals_itself_without():
    """Swap-out, swap-in and recompute of an fp8 KV give the tokens of a pool that never
    evicts: the scales travel with their chunks (int8's take the same copies)."""
    plan = None
    outs, counters = [], []
    for pools in (
        {"gpu_cache_chunks": 256, "cpu_cache_chunks": 0},
        {"gpu_cache_chunks": 9, "cpu_cache_chunks": 4, "max_batch_tokens": 64},
    ):
        engine = Engine(EngineConfig(model="dummy:tiny", device="cpu", kv_dtype="fp8", **pools))
        plan = plan or prompts(engine, 4, 3, seed=1, min_len=40, max_len=64)
        outs.append(serve(engine, plan, max_tokens=24, ignore_eos=True))
        counters.append(engine.snapshot().counters)
    roomy, tight = counters
    assert roomy.swapped_in_tokens == roomy.recomputed_tokens == 0
    assert tight.swapped_in_tokens > 0 and tight.recomputed_tokens > 0, tight
    assert outs[0] == outs[1]
