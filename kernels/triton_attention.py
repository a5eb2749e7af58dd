"""Multi-token paged attention in Triton: causal attention of every sub-request over the paged pool.

Work is cut into programs along three axes:

- query tiles x KV heads: one program computes `BLOCK_Q` query tokens of one sub-request times
  the `GROUP` query heads that share one KV head, packed densely into `BLOCK_M` rows (a power
  of two; rows past `BLOCK_Q * GROUP` are masked). Every K/V tile is thus loaded once per KV
  head, not once per query head, and a decode token's whole group rides in one program;
- key segments (split-K, flash-decoding): when those programs are too few to fill the GPU
  (decode at small batch, GQA), the keys of each tile are split into `NUM_SEGS` segments run by
  separate programs, and `_merge_segments_kernel` merges their partial results with a
  log-sum-exp merge.

Keys are streamed in tiles of `TILE_N` positions, each position looked up through the block
table, with an online softmax (scores never leave registers).

The grid needs no host sync: sub-request s owns program ids starting at
`query_start[s] // BLOCK_Q + s`, an upper bound on its number of query tiles, and each program finds
its sub-request by binary search over that. Programs past the end of their sub-request exit.

The launch shape (`LaunchConfig`: rows, key tile, segments, warps, stages) depends only on sizes
the host knows (tokens, sub-requests, heads, the block table's width), so it is picked once per
step and cached, with the segment buffers, in `meta.derived`: every layer reuses it.

A sliding window (a runtime argument: one compiled kernel serves every layer) hides the keys
a query is `window` or more positions past (kernels/reference.py), and the key tiles before
a program's first visible key are skipped: split-KV segments divide only the tiles left.

Attention sinks (gpt-oss: one logit per query head, an optional pointer) add exp(sink) to
each row's softmax denominator once, where its result is final: in the kernel without
split-KV, in the merge with it (the segments' partials stay sink-free).

An 8-bit pool (`kernels.quant.QuantizedKV`) is dequantized tile by tile as it is loaded:
codes times the key's scale, rounded to q's dtype, exactly as the PyTorch reference does
before its attention.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.metadata import AttentionMetadata
from kernels.quant import QuantizedKV
from kernels.triton_cache import QUANT_KIND, QUANT_NONE

LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(query_start_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest s with query_start[s] // BLOCK_Q + s <= pid."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _dequantize(codes, scale, QUANT: tl.constexpr, DTYPE: tl.constexpr):
    """8-bit codes times their float16 scales (broadcast by the caller), rounded to DTYPE."""
    if QUANT == 1:
        x = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        x = codes.to(tl.float32)
    return (x * scale.to(tl.float32)).to(DTYPE)


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    k_scale_ptr,  # [num_blocks, block_size, kv_heads] float16, 8-bit pools only
    v_scale_ptr,
    table_ptr,
    query_start_ptr,
    query_pos_ptr,
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SEGS, HEAD_PAD] fp32, split-KV only
    part_ml_ptr,  # [num_tokens, num_heads, NUM_SEGS, 2] fp32 (running max, sum), split-KV only
    sinks_ptr,  # [num_heads] fp32 sink logits (HAS_SINKS only)
    scale_log2,
    window,  # keys at window or more positions back are hidden (NO_WINDOW: none)
    num_seqs,
    num_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
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
    stride_table,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_Q * GROUP, padded to a power of two
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SEGS: tl.constexpr,
    QUANT: tl.constexpr,  # 0: the pool holds q's dtype, 1: fp8 e4m3 codes, 2: int8 codes
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    seg = tl.program_id(2)

    seq = _find_seq(query_start_ptr, pid, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    tile = pid - (q_start // BLOCK_Q + seq)
    if tile * BLOCK_Q >= q_len:
        return
    pos0 = tl.load(query_pos_ptr + seq)

    # Row r is query token r // GROUP of the tile, head r % GROUP of the group: dense, so a
    # group of 3, 5 or 10 heads wastes only the rows past BLOCK_Q * GROUP.
    rows = tl.arange(0, BLOCK_M)
    qi = tile * BLOCK_Q + rows // GROUP  # query index within the sub-request
    hg = rows % GROUP  # head within the group
    row_ok = (qi < q_len) & (rows < BLOCK_Q * GROUP)
    head = kvh * GROUP + hg
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    token = (q_start + qi).to(tl.int64)

    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    q_abs = pos0 + qi  # absolute position of each row's query

    # Keys this tile needs: up to its last real query, from its first query's window on.
    kv_len = pos0 + tl.minimum(tile * BLOCK_Q + BLOCK_Q, q_len)
    num_tiles = tl.cdiv(kv_len, TILE_N)
    first_tile = tl.maximum(pos0 + tile * BLOCK_Q - window + 1, 0) // TILE_N
    if NUM_SEGS > 1:
        # This sub-request's own tiles split evenly: a short context leaves late segments
        # empty (they store an empty partial, which the merge weighs 0).
        per_seg = tl.cdiv(num_tiles - first_tile, NUM_SEGS)
        t_lo = first_tile + seg * per_seg
        t_hi = tl.minimum(t_lo + per_seg, num_tiles)
    else:
        t_lo = first_tile
        t_hi = num_tiles

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    table_row = table_ptr + seq.to(tl.int64) * stride_table
    cols = tl.arange(0, TILE_N)

    for t in range(t_lo, t_hi):
        kpos = t * TILE_N + cols
        k_ok = kpos < kv_len
        block = tl.load(table_row + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        slot = kpos % BLOCK_SIZE
        k_off = block * stride_kb + slot * stride_kt + kvh * stride_kh
        v_off = block * stride_vb + slot * stride_vt + kvh * stride_vh
        kt = tl.load(
            k_ptr + k_off[None, :] + dims[:, None],
            mask=k_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )  # [HEAD_PAD, TILE_N]
        v = tl.load(
            v_ptr + v_off[:, None] + dims[None, :],
            mask=k_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )  # [TILE_N, HEAD_PAD]
        if QUANT != 0:
            ks = tl.load(
                k_scale_ptr + block * stride_ksb + slot * stride_kst + kvh, mask=k_ok, other=0.0
            )
            vs = tl.load(
                v_scale_ptr + block * stride_vsb + slot * stride_vst + kvh, mask=k_ok, other=0.0
            )
            kt = _dequantize(kt, ks[None, :], QUANT, out_ptr.dtype.element_ty)
            v = _dequantize(v, vs[:, None], QUANT, out_ptr.dtype.element_ty)
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PRECISION) * scale_log2
        back = q_abs[:, None] - kpos[None, :]  # how far back each key is from each query
        visible = (back >= 0) & (back < window) & k_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row may see no key of this tile yet (split-KV segments): keep exp2 finite.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if NUM_SEGS > 1:
        part = (token[:, None] * num_heads + head[:, None]) * NUM_SEGS + seg
        tl.store(
            part_acc_ptr + part * HEAD_PAD + dims[None, :],
            acc,
            mask=row_ok[:, None],
        )
        ml = part_ml_ptr + (token * num_heads + head) * (NUM_SEGS * 2) + seg * 2
        tl.store(ml, m_i, mask=row_ok)
        tl.store(ml + 1, l_i, mask=row_ok)
    else:
        if HAS_SINKS:
            # l * 2^m + 2^sink (log2 units), over their common max: neither overflows
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
            sink = sink * 1.4426950408889634  # log2(e)
            top = tl.maximum(m_i, sink)
            kept = tl.where(m_i == float("-inf"), 0.0, tl.math.exp2(m_i - top))
            acc = acc * kept[:, None]
            l_i = l_i * kept + tl.math.exp2(sink - top)
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )


@triton.jit
def _merge_segments_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    sinks_ptr,
    query_start_ptr,
    num_seqs,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SEGS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """out[t, h] = sum_s exp2(m_s - M) acc_s / sum_s exp2(m_s - M) l_s (log-sum-exp merge);
    with sinks, M also covers the head's sink and exp2(sink - M) joins the denominator."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    if token >= tl.load(query_start_ptr + num_seqs):
        return  # padding row past the last sub-request: nothing was computed for it
    segs = tl.arange(0, NUM_SEGS)
    dims = tl.arange(0, HEAD_PAD)
    base = token.to(tl.int64) * num_heads + head
    ml = part_ml_ptr + base * (NUM_SEGS * 2) + segs * 2
    m = tl.load(ml)
    lsum = tl.load(ml + 1)
    m_max = tl.max(m, 0)
    if HAS_SINKS:
        m_max = tl.maximum(m_max, tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634)
    w = tl.where(m == float("-inf"), 0.0, tl.math.exp2(m - m_max))
    acc = tl.load(part_acc_ptr + (base * NUM_SEGS + segs[:, None]) * HEAD_PAD + dims[None, :])
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(lsum * w, 0)
    if HAS_SINKS:
        den = den + tl.math.exp2(
            tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634 - m_max
        )
    den = tl.where(den == 0.0, 1.0, den)
    tl.store(
        out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + dims,
        (num / den).to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: small, so that tests reach the split path
    return torch.cuda.get_device_properties(device).multi_processor_count


# Split-KV policy. Decode streams K/V and is bound by memory latency: each SM wants several
# programs in flight. Segments are added while the grid stays under PROGRAMS_PER_SM x SMs and
# every segment keeps MIN_KEYS_PER_ROW keys per row of its program: a segment's partial (one
# fp32 row of head_dim per program row) then costs at most 1/16 of the 16-bit K/V it read.
PROGRAMS_PER_SM = 4
MIN_KEYS_PER_ROW = 16
MAX_SEGS = 64
NO_WINDOW = 1 << 30  # the window argument when there is none: past any position


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int  # rows per program: block_q query tokens x group heads, padded to a power of 2
    block_q: int  # query tokens per program
    tile_n: int  # keys per step of the online softmax
    num_segs: int  # split-KV segments (a power of two; 1: no split, no merge)
    num_warps: int
    num_stages: int


def pick_config(
    num_tokens: int,
    num_seqs: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    max_context: int,
    sms: int,
) -> LaunchConfig:
    """The launch shape from host-known sizes only (no sync on the metadata).

    `max_context` bounds every sub-request's keys (the block table's width x block size)."""
    avg_q = num_tokens / max(num_seqs, 1)
    # Decode-like batches: 16 rows (the smallest tensor-core tile). Longer queries: 64 rows.
    target = 64 if avg_q * group >= 48 else 16
    block_m = max(target, triton.next_power_of_2(group))
    block_q = block_m // group
    if block_m <= 16:
        tile_n, warps, stages = 64, 4, 2
    else:
        # Long prompts are compute-bound: narrower key tiles keep the accumulators in registers.
        tile_n = 32 if avg_q >= 64 and head_dim > 64 else 64
        warps, stages = (4 if block_m <= 64 else 8), 3
    programs = max(num_seqs, -(-num_tokens // block_q)) * num_kv_heads
    segs = 1
    while (
        segs * 2 <= MAX_SEGS
        and programs * segs * 2 <= PROGRAMS_PER_SM * sms
        and max_context >= MIN_KEYS_PER_ROW * block_m * segs * 2
    ):
        segs *= 2
    return LaunchConfig(block_m, block_q, tile_n, segs, warps, stages)


@dataclass
class _Plan:
    """What every layer of a step shares: the launch shape and the segment buffers."""

    cfg: LaunchConfig
    part_acc: torch.Tensor | None  # [num_tokens, num_heads, num_segs, head_pad] fp32
    part_ml: torch.Tensor | None  # [num_tokens, num_heads, num_segs, 2] fp32


def _plan(
    q: torch.Tensor,
    num_kv_heads: int,
    block_size: int,
    meta: AttentionMetadata,
    num_segs: int | None,
    config: LaunchConfig | None,
) -> _Plan:
    num_tokens, num_heads, head_dim = q.shape
    key = ("triton_plan", num_tokens, num_heads, num_kv_heads, head_dim, block_size, num_segs)
    key += (config, q.device)
    plan = meta.derived.get(key)
    if plan is not None:
        return plan
    if config is None:
        config = pick_config(
            num_tokens,
            meta.num_seqs,
            num_kv_heads,
            num_heads // num_kv_heads,
            head_dim,
            meta.block_tables.shape[1] * block_size,
            _num_sms(q.device),
        )
        if num_segs is not None:
            config = LaunchConfig(**{**config.__dict__, "num_segs": num_segs})
    segs = config.num_segs
    if segs < 1 or segs & (segs - 1):
        raise ValueError("num_segs must be a power of two")
    bm = config.block_m
    if bm < 16 or bm & (bm - 1) or config.block_q * (num_heads // num_kv_heads) > bm:
        raise ValueError("block_m must be a power of two >= 16 holding block_q x group rows")
    part_acc = part_ml = None
    if segs > 1:
        # Shared by the layers of the step: they run one after another on one stream.
        head_pad = max(16, triton.next_power_of_2(head_dim))
        f32 = dict(dtype=torch.float32, device=q.device)
        part_acc = torch.empty((num_tokens, num_heads, segs, head_pad), **f32)
        part_ml = torch.empty((num_tokens, num_heads, segs, 2), **f32)
    plan = meta.derived[key] = _Plan(config, part_acc, part_ml)
    return plan


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor | QuantizedKV,
    v_cache: torch.Tensor | QuantizedKV,
    meta: AttentionMetadata,
    scale: float,
    num_segs: int | None = None,
    out: torch.Tensor | None = None,
    config: LaunchConfig | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q/out [num_tokens, num_heads, head_dim]; caches [num_blocks, block_size, kv_heads, head_dim].
    `window`: a query sees only the keys fewer than `window` positions back (None: all).
    `sinks` [num_heads]: each head's sink logit in every softmax's denominator (None: none).

    `num_segs` forces the number of split-KV segments (a power of two); `config` forces the whole
    launch shape (benchmarks); None picks from the shapes. `out` (shaped like q) receives the
    result if given. Rows past query_start[-1] are left unwritten.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    if k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must have the same shape")
    quant = QUANT_NONE
    k_scale, v_scale = k_cache, v_cache  # unused unless 8-bit
    if isinstance(k_cache, QuantizedKV) or isinstance(v_cache, QuantizedKV):
        if not (isinstance(k_cache, QuantizedKV) and isinstance(v_cache, QuantizedKV)):
            raise ValueError("K and V pools must both be 8-bit or neither")
        if k_cache.fmt != v_cache.fmt:
            raise ValueError("K and V pools must share their 8-bit format")
        quant = QUANT_KIND[k_cache.fmt]
        k_scale, v_scale = k_cache.scales, v_cache.scales
        k_cache, v_cache = k_cache.codes, v_cache.codes
        if k_scale.stride(-1) != 1 or v_scale.stride(-1) != 1:
            raise ValueError("kv_heads must be the contiguous dimension of the scales")
    elif k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError("q, k_cache and v_cache must share dtype (or the pool be 8-bit)")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("head_dim must be the contiguous dimension of q and the caches")
    if sinks is not None and (sinks.shape != (num_heads,) or sinks.device != q.device):
        raise ValueError(f"sinks must be [{num_heads}] on q's device, one per query head")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError("out must be shaped like q")
    num_seqs = meta.num_seqs
    if num_tokens == 0 or num_seqs == 0:
        return out
    plan = _plan(q, num_kv_heads, block_size, meta, num_segs, config)
    cfg = plan.cfg
    head_pad = max(16, triton.next_power_of_2(head_dim))
    grid_q = num_tokens // cfg.block_q + num_seqs
    part_acc = plan.part_acc if plan.part_acc is not None else out  # unused when not split
    part_ml = plan.part_ml if plan.part_ml is not None else out
    # The CPU interpreter multiplies bf16 tiles wrongly: do those dots in fp32 there.
    upcast = _interpreting() and q.dtype == torch.bfloat16
    _paged_attention_kernel[(grid_q, num_kv_heads, cfg.num_segs)](
        out,
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        meta.block_tables,
        meta.query_start,
        meta.query_pos,
        part_acc,
        part_ml,
        sinks if sinks is not None else out,  # unused without sinks
        scale * LOG2E,
        window or NO_WINDOW,
        num_seqs,
        num_heads,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        k_scale.stride(0) if quant else 0,
        k_scale.stride(1) if quant else 0,
        v_scale.stride(0) if quant else 0,
        v_scale.stride(1) if quant else 0,
        meta.block_tables.stride(0),
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        GROUP=num_heads // num_kv_heads,
        BLOCK_Q=cfg.block_q,
        BLOCK_M=cfg.block_m,
        TILE_N=cfg.tile_n,
        BLOCK_SIZE=block_size,
        NUM_SEGS=cfg.num_segs,
        QUANT=quant,
        UPCAST=upcast,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_SINKS=sinks is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if cfg.num_segs > 1:
        _merge_segments_kernel[(num_tokens, num_heads)](
            out,
            part_acc,
            part_ml,
            sinks if sinks is not None else out,
            meta.query_start,
            num_seqs,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_PAD=head_pad,
            NUM_SEGS=cfg.num_segs,
            HAS_SINKS=sinks is not None,
        )
    return out
