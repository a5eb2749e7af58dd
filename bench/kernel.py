"""Kernel benchmark (CUDA only): multi-token paged attention against the ways around it.

Methods, for 32 requests x 8 new query tokens over 1k-16k tokens of shuffled, non-contiguous
KV blocks: `triton` (the paged kernel, one call), `copy-out` (gather KV, then SDPA),
`multi-round` (8 decode calls), `ideal` (contiguous KV, SDPA flash) and `flex`
(FlexAttention, bottom-right causal). Also decode batches 1-256 (with `triton-nosplit`
and `triton-int8`) and a mixed prompt + decode batch. Per point `ms` (one eager call,
launch included) and `graph_ms` (device time per call from a CUDA graph of 10 calls: the
issue 11 goal, Triton within 1.10x of the ideal, is judged on it). Writes
bench/results/kernel-<device>.json and .png; `--part sweep` times launch shapes around
`pick_config`'s default (kernel-sweep-<device>.json); `--dry-run` runs tiny shapes on the
CPU to check the plumbing (numbers meaningless).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.lib.common import device_slug, write_json
from bench.lib.timing import eager_ms, header
from bench.lib.timing import graph_ms as graph_device_ms
from kernels import AttentionMetadata, QuantizedKV, paged_attention
from kernels.quant import quantize

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class HeadConfig:
    name: str
    heads: int
    kv_heads: int
    head_dim: int


CONFIGS = [
    HeadConfig("llama-2-13b", 40, 40, 128),
    HeadConfig("llama-2-13b-gqa10", 40, 4, 128),
    HeadConfig("llama-3-8b", 32, 8, 128),  # GQA 4
]
DECODE_BATCHES = (1, 8, 16, 64, 256)


@dataclass
class Point:
    scenario: str  # "multi-token" | "decode" | "mixed"
    config: str
    method: str
    batch: int
    q_len: int  # query tokens per request (mixed: total tokens)
    context: int  # context tokens before the new queries
    ms: float | None  # eager, host launch included
    tflops: float | None = None
    gbps: float | None = None
    note: str = ""
    graph_ms: float | None = None  # device time per call in a CUDA graph


@dataclass
class Bench:
    device: torch.device
    dtype: torch.dtype
    block_size: int
    iters: int
    max_pool_bytes: int
    dry: bool
    use_flex: bool = True
    graphs: bool = True  # also time captured CUDA graphs (CUDA only)
    points: list[Point] = field(default_factory=list)

    def record(
        self, base: Point, method: str, fn, flops: int, nbytes: int, note: str = "", graph=False
    ) -> Point | None:
        """Time fn eagerly (and from a CUDA graph if `graph`); None if the method failed."""
        graph_ms = None
        try:
            ms = eager_ms(fn, self.iters, self.device.type == "cuda", 2 if self.dry else 5)
            if graph and self.graphs and self.device.type == "cuda":
                graph_ms = graph_device_ms(fn, self.iters)
        except (RuntimeError, torch.OutOfMemoryError) as e:  # a method may not support a shape
            self.points.append(Point(**{**asdict(base), "method": method, "note": str(e)[:200]}))
            print(f"  {method:<12} failed: {str(e)[:120]}", file=sys.stderr)
            return None
        finally:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        p = Point(**{**asdict(base), "method": method, "ms": ms, "note": note})
        p.graph_ms = graph_ms
        device_ms = graph_ms or ms
        p.tflops = flops / (device_ms * 1e-3) / 1e12
        p.gbps = nbytes / (device_ms * 1e-3) / 1e9
        self.points.append(p)
        graphed = f" graph {graph_ms:8.4f} ms" if graph_ms else ""
        print(
            f"  {p.scenario:<11} {p.config:<18} b={p.batch:<4} q={p.q_len:<5} ctx={p.context:<6}"
            f" {method:<14} {ms:9.4f} ms{graphed} {p.tflops:7.2f} TFLOP/s {p.gbps:8.1f} GB/s"
            + (f"  {note}" if note and p.scenario == "sweep" else "")
        )
        return p

    # ------------------------------------------------------------ data

    def pool(self, cfg: HeadConfig, blocks_per_seq: list[int], seed: int = 0):
        """A random pool and shuffled, non-contiguous block tables."""
        ids = list(range(sum(blocks_per_seq)))
        random.Random(seed).shuffle(ids)
        tables, at = [], 0
        for n in blocks_per_seq:
            tables.append(ids[at : at + n])
            at += n
        shape = (len(ids), self.block_size, cfg.kv_heads, cfg.head_dim)
        k = torch.randn(shape, device=self.device, dtype=self.dtype)
        v = torch.randn(shape, device=self.device, dtype=self.dtype)
        return k, v, tables

    def fitting_pool(self, cfg: HeadConfig, batch: int, q_len: int, contexts: list[int]):
        """The contexts whose KV fits in max_pool_bytes, and a pool for the longest."""
        fits = [
            c for c in contexts if self.pool_bytes(cfg, batch * (c + q_len)) <= self.max_pool_bytes
        ]
        if not fits:
            return [], None, None, []
        return fits, *self.pool(cfg, [-(-(max(fits) + q_len) // self.block_size)] * batch)

    def pool_bytes(self, cfg: HeadConfig, tokens: int) -> int:
        return 2 * tokens * cfg.kv_heads * cfg.head_dim * self.dtype.itemsize

    def meta(self, q_lens, positions, tables) -> AttentionMetadata:
        bs = self.block_size
        cut = [t[: -(-(p + n) // bs)] for t, n, p in zip(tables, q_lens, positions, strict=True)]
        return AttentionMetadata.build(q_lens, positions, cut, self.device)

    def point(self, scenario: str, cfg: HeadConfig, batch: int, q_len: int, context: int):
        """A point's base, its queries, useful FLOPs and bytes moved (KV read, q in and out)."""
        base = Point(scenario, cfg.name, "", batch, q_len, context, None)
        q = torch.randn(
            batch * q_len, cfg.heads, cfg.head_dim, device=self.device, dtype=self.dtype
        )
        flops = attention_flops([q_len] * batch, [context] * batch, cfg.heads, cfg.head_dim)
        nbytes = self.pool_bytes(cfg, batch * (context + q_len)) + 2 * q.numel() * q.element_size()
        return base, q, flops, nbytes

    # ------------------------------------------------------------ methods

    def paged(self, q, k, v, meta, scale, **kw):
        if self.dry and not _interpreting():
            return lambda: paged_attention(q, k, v, meta, scale, backend="torch")
        from kernels.triton_attention import paged_attention_triton

        out = torch.empty_like(q)  # one output for every call: graphs stay small
        return lambda: paged_attention_triton(q, k, v, meta, scale, out=out, **kw)

    def quantized(self, cache: torch.Tensor, fmt: str, step: int = 256) -> QuantizedKV:
        """An 8-bit copy of a pool, quantized a few blocks at a time (float32 temporaries)."""
        parts = [quantize(cache[b : b + step], fmt) for b in range(0, cache.shape[0], step)]
        return QuantizedKV(torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts]), fmt)

    def copy_out(self, q, k, v, tables, q_len, context, scale):
        """Gather every request's KV into a contiguous tensor, then one SDPA call."""
        bs, (b, kvh, d) = self.block_size, (len(tables), k.shape[2], k.shape[3])
        length = context + q_len
        n_blocks = -(-length // bs)
        idx = torch.tensor([t[:n_blocks] for t in tables], device=self.device, dtype=torch.long)
        qi = torch.arange(q_len, device=self.device)[:, None] + context
        mask = torch.arange(length, device=self.device)[None, :] <= qi
        qs = q.view(b, q_len, -1, d).transpose(1, 2)

        def run():
            kc = k[idx].view(b, n_blocks * bs, kvh, d)[:, :length].transpose(1, 2).contiguous()
            vc = v[idx].view(b, n_blocks * bs, kvh, d)[:, :length].transpose(1, 2).contiguous()
            return F.scaled_dot_product_attention(
                qs, kc, vc, attn_mask=mask, scale=scale, enable_gqa=kvh != qs.shape[1]
            )

        return run

    def contiguous(self, k, v, tables, length):
        bs, b = self.block_size, len(tables)
        n_blocks = -(-length // bs)
        idx = torch.tensor([t[:n_blocks] for t in tables], device=self.device, dtype=torch.long)
        shape = (b, n_blocks * bs, k.shape[2], k.shape[3])
        kc = k[idx].view(shape)[:, :length].transpose(1, 2).contiguous()
        vc = v[idx].view(shape)[:, :length].transpose(1, 2).contiguous()
        return kc, vc

    def ideal(self, qs, kc, vc, scale):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = [SDPBackend.MATH] if self.dry else [SDPBackend.FLASH_ATTENTION]
        gqa = kc.shape[1] != qs.shape[1]

        def run():
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(qs, kc, vc, scale=scale, enable_gqa=gqa)

        return run

    def flex(self, qs, kc, vc, q_len, context, scale):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        b, h = qs.shape[:2]

        def causal(b_, h_, qi, ki):
            return ki <= qi + context

        block_mask = create_block_mask(causal, b, None, q_len, context + q_len, device=self.device)
        compiled = _compiled_flex(flex_attention)
        gqa = kc.shape[1] != h
        return lambda: compiled(qs, kc, vc, block_mask=block_mask, scale=scale, enable_gqa=gqa)

    def contiguous_methods(self, cfg, base, q, k, v, tables, flops, nbytes, flex=False):
        """`ideal` (and `flex`) over a contiguous copy of the KV; the ideal's point."""
        q_len, context = base.q_len, base.context
        scale = 1 / math.sqrt(cfg.head_dim)
        try:
            kc, vc = self.contiguous(k, v, tables, context + q_len)
        except torch.OutOfMemoryError:
            print("  no memory for a contiguous copy: ideal skipped", file=sys.stderr)
            return None
        qt = q.view(base.batch, q_len, cfg.heads, cfg.head_dim).transpose(1, 2)
        ideal = self.record(base, "ideal", self.ideal(qt, kc, vc, scale), flops, nbytes, graph=True)
        if flex and self.use_flex and not self.dry:
            fn = self.flex(qt, kc, vc, q_len, context, scale)
            self.record(base, "flex", fn, flops, nbytes)
        del kc, vc
        return ideal

    # ------------------------------------------------------------ scenarios

    def multi_token(self, cfg: HeadConfig, batch: int, q_len: int, contexts: list[int]):
        """The paper's figure: batch requests, q_len new tokens each, growing context."""
        scale = 1 / math.sqrt(cfg.head_dim)
        fits, k, v, tables = self.fitting_pool(cfg, batch, q_len, contexts)
        for context in fits:
            base, q, flops, nbytes = self.point("multi-token", cfg, batch, q_len, context)
            meta = self.meta([q_len] * batch, [context] * batch, tables)
            self.record(base, "triton", self.paged(q, k, v, meta, scale), flops, nbytes, graph=True)
            qs = q.view(batch, q_len, cfg.heads, cfg.head_dim)
            metas = [self.meta([1] * batch, [context + i] * batch, tables) for i in range(q_len)]
            steps = [self.paged(qs[:, i].contiguous(), k, v, m, scale) for i, m in enumerate(metas)]
            fn = lambda steps=steps: [s() for s in steps]  # noqa: E731
            self.record(base, "multi-round", fn, flops, nbytes, graph=True)
            fn = self.copy_out(q, k, v, tables, q_len, context, scale)
            self.record(base, "copy-out", fn, flops, nbytes)
            self.contiguous_methods(cfg, base, q, k, v, tables, flops, nbytes, flex=True)

    def decode(self, cfg: HeadConfig, batch: int, contexts: list[int], int8: bool = True):
        scale = 1 / math.sqrt(cfg.head_dim)
        fits, k, v, tables = self.fitting_pool(cfg, batch, 1, contexts)
        kq = vq = None
        if fits and int8 and (not self.dry or _interpreting()):
            kq, vq = self.quantized(k, "int8"), self.quantized(v, "int8")
        for context in fits:
            base, q, flops, nbytes = self.point("decode", cfg, batch, 1, context)
            m, nosplit, m8 = (self.meta([1] * batch, [context] * batch, tables) for _ in range(3))
            note = self.plan_note(q, k, m, scale)
            fn = self.paged(q, k, v, m, scale)
            self.record(base, "triton", fn, flops, nbytes, note, graph=True)
            fn = self.paged(q, k, v, nosplit, scale, num_segs=1)
            self.record(base, "triton-nosplit", fn, flops, nbytes, graph=True)
            if kq is not None:
                # Reads half the K/V bytes (plus 2 bytes of scale per head_dim codes).
                qbytes = nbytes // 2 + nbytes // (2 * cfg.head_dim)
                fn = self.paged(q, kq, vq, m8, scale)
                self.record(base, "triton-int8", fn, flops, qbytes, "8-bit pool", graph=True)
            if batch <= 64:  # bounded: the gather is slow and its timing known
                fn = self.copy_out(q, k, v, tables, 1, context, scale)
                self.record(base, "copy-out", fn, flops, nbytes)
            self.contiguous_methods(cfg, base, q, k, v, tables, flops, nbytes)

    def plan_note(self, q, k, meta, scale) -> str:
        """The launch shape the kernel picks for this step (empty on the torch backend)."""
        if self.dry and not _interpreting():
            return ""
        from kernels.triton_attention import paged_attention_triton

        paged_attention_triton(q, k, k, meta, scale)  # fills meta.derived
        plans = [p for key, p in meta.derived.items() if key[0] == "triton_plan"]
        return config_label(plans[0].cfg) if plans else ""

    def sweep(self, cfg: HeadConfig, batch: int, contexts: list[int]):
        """Decode at one batch size: the default launch shape and its neighbours (key tile,
        segments, stages), each timed from a CUDA graph, against the contiguous ideal."""
        from kernels.triton_attention import _num_sms, pick_config

        bs, scale = self.block_size, 1 / math.sqrt(cfg.head_dim)
        fits, k, v, tables = self.fitting_pool(cfg, batch, 1, contexts)
        sms = _num_sms(self.device) if fits else 0
        for context in fits:
            base, q, flops, nbytes = self.point("sweep", cfg, batch, 1, context)
            width = -(-(context + 1) // bs)
            group = cfg.heads // cfg.kv_heads
            default = pick_config(batch, batch, cfg.kv_heads, group, cfg.head_dim, width * bs, sms)
            shapes = {default}
            for tile_n in (16, 32, 64, 128):
                tiles = -(-(context + 1) // tile_n)
                for stages in (2, 3):
                    segs = 1
                    while segs <= min(64, tiles) and batch * cfg.kv_heads * segs <= 16 * sms:
                        shapes.add(
                            replace(default, tile_n=tile_n, num_segs=segs, num_stages=stages)
                        )
                        segs *= 2
            best = None
            for shape in sorted(shapes, key=config_label):
                meta = self.meta([1] * batch, [context] * batch, tables)
                fn = self.paged(q, k, v, meta, scale, config=shape)
                label = config_label(shape) + (" (default)" if shape == default else "")
                p = self.record(base, "triton", fn, flops, nbytes, label, graph=True)
                if p is not None and (best is None or _device_ms(p) < _device_ms(best)):
                    best = p
            ideal = self.contiguous_methods(cfg, base, q, k, v, tables, flops, nbytes)
            if best is not None and ideal is not None:
                ratio = _device_ms(best) / _device_ms(ideal)
                print(f"  best {best.note}: {ratio:.2f}x the ideal", file=sys.stderr)

    def mixed(self, cfg: HeadConfig, prompts: int, prompt_len: int, decodes: int, context: int):
        """A unified step: a few prompts over their history plus many decode rows."""
        bs, scale = self.block_size, 1 / math.sqrt(cfg.head_dim)
        q_lens = [prompt_len] * prompts + [1] * decodes
        positions = [context] * (prompts + decodes)
        k, v, tables = self.pool(cfg, [-(-(context + n) // bs) for n in q_lens])
        q = torch.randn(sum(q_lens), cfg.heads, cfg.head_dim, device=self.device, dtype=self.dtype)
        meta = self.meta(q_lens, positions, tables)
        flops = attention_flops(q_lens, positions, cfg.heads, cfg.head_dim)
        tokens = sum(context + n for n in q_lens)
        nbytes = self.pool_bytes(cfg, tokens) + 2 * q.numel() * q.element_size()
        base = Point("mixed", cfg.name, "", prompts + decodes, sum(q_lens), context, None)
        note = f"{prompts} prompts x {prompt_len} + {decodes} decodes"
        self.record(
            base, "triton", self.paged(q, k, v, meta, scale), flops, nbytes, note, graph=True
        )
        fn = lambda: paged_attention(q, k, v, meta, scale, backend="torch")  # noqa: E731
        note += "; per-sub-request gather + SDPA, decodes batched"
        self.record(base, "torch-reference", fn, flops, nbytes, note)


_FLEX = None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _device_ms(p: Point) -> float:
    return p.graph_ms or p.ms


def config_label(cfg) -> str:
    return (
        f"m{cfg.block_m} q{cfg.block_q} n{cfg.tile_n} segs{cfg.num_segs}"
        f" w{cfg.num_warps} s{cfg.num_stages}"
    )


def summarize(points: list[dict]) -> dict:
    """Triton over the contiguous ideal at every point where both ran (graph time where
    measured): the figure of issue 11's kernel goal (<= 1.10x)."""
    by_point: dict[tuple, dict[str, float]] = {}
    for p in points:
        if p["ms"] is not None and p["scenario"] in ("multi-token", "decode"):
            key = (p["scenario"], p["config"], p["batch"], p["context"])
            by_point.setdefault(key, {})[p["method"]] = p["graph_ms"] or p["ms"]
    rows = [
        dict(scenario=scenario, config=config, batch=batch, context=context,
             triton_ms=ms["triton"], ideal_ms=ms["ideal"], ratio=round(ms["triton"] / ms["ideal"], 3))
        for (scenario, config, batch, context), ms in sorted(by_point.items())
        if "triton" in ms and "ideal" in ms
    ]  # fmt: skip
    worst = max(rows, key=lambda r: r["ratio"], default=None)
    return {
        "timing": "graph_ms where measured, else ms",
        "goal": 1.10,
        "max_ratio": worst["ratio"] if worst else None,
        "worst": worst,
        "over_goal": [r for r in rows if r["ratio"] > 1.10],
        "ratios": rows,
    }


def _compiled_flex(flex_attention):
    """One compiled FlexAttention for all shapes (each new shape recompiles once)."""
    global _FLEX
    if _FLEX is None:
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = 64
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def attention_flops(q_lens: list[int], positions: list[int], heads: int, head_dim: int) -> int:
    """Useful FLOPs of causal attention: QK^T and PV over the keys each query sees."""
    visible = sum(n * p + n * (n + 1) // 2 for n, p in zip(q_lens, positions, strict=True))
    return 4 * visible * heads * head_dim


def _lines(ax, series: dict, **kw) -> None:
    for label, (xy, style) in sorted(series.items()):
        xy.sort()
        ax.plot([x for x, _ in xy], [y for _, y in xy], label=label, **style, **kw)


def plot(points: list[dict], title: str, path: Path) -> None:
    from bench.lib.plots import plt, save_fig

    ok = [{**p, "ms": p["graph_ms"] or p["ms"]} for p in points if p["ms"] is not None]
    color = {m: f"C{i}" for i, m in enumerate(sorted({p["method"] for p in ok}))}
    styles = {1: (0, (1, 3)), 8: ":", 16: "-.", 64: "--", 256: "-"}
    names = [c.name for c in CONFIGS]
    ratios = summarize(points)["ratios"]
    fig, axes = plt.subplots(len(names), 3, figsize=(18, 4.8 * len(names)), squeeze=False)
    for row, cfg in enumerate(names):
        for col, scenario in enumerate(("multi-token", "decode")):
            ax, series = axes[row, col], {}
            for p in ok:
                if p["scenario"] == scenario and p["config"] == cfg:
                    decode = scenario == "decode"
                    label = f"{p['method']} b={p['batch']}" if decode else p["method"]
                    style = {"color": color[p["method"]],
                             "linestyle": styles.get(p["batch"], "-") if decode else "-"}  # fmt: skip
                    series.setdefault(label, ([], style))[0].append((p["context"], p["ms"]))
            _lines(ax, series, marker="o")
            what = "32 requests x 8 new tokens" if scenario == "multi-token" else "decode"
            ax.set_title(f"{what}, {cfg}")
            ax.set_yscale("log")
            ax.set_ylabel("latency (ms, median; graph time where measured)")
            if series:
                ax.legend(fontsize=6, ncol=3 if scenario == "decode" else 1)
        ax, series = axes[row, 2], {}  # Triton over the ideal, per scenario and batch size
        for r in ratios:
            if r["config"] == cfg:
                style = {"marker": "o" if r["scenario"] == "decode" else "s",
                         "linestyle": styles.get(r["batch"], "-")}  # fmt: skip
                label = f"{r['scenario']} b={r['batch']}"
                series.setdefault(label, ([], style))[0].append((r["context"], r["ratio"]))
        _lines(ax, series)
        ax.axhline(1.10, color="red", linewidth=0.8, label="goal 1.10x")
        ax.set_ylabel("triton / ideal")
        ax.set_title(f"Triton over the contiguous ideal, {cfg}")
        if series:
            ax.legend(fontsize=6, ncol=2)
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title)
    save_fig(fig, path, dpi=100)


def save(bench: Bench, name: str, out_dir: Path, part: str = "") -> None:
    points = [asdict(p) for p in bench.points]
    dtype = str(bench.dtype).removeprefix("torch.")
    result = {
        **header(name, bench.device, dtype, bench.iters, block_size=bench.block_size),
        "summary": summarize(points),
        "points": points,
    }
    stem = out_dir / f"kernel-{part + '-' if part else ''}{device_slug(name)}"
    write_json(stem.with_suffix(".json"), result)
    if part != "sweep":
        title = f"Paged attention on {name} ({result['dtype']}, block {bench.block_size})"
        plot(points, title, stem.with_suffix(".png"))
    worst = result["summary"]["worst"]
    if worst:
        print(
            f"triton / ideal: at most {worst['ratio']:.2f}x ({worst['scenario']}, "
            f"{worst['config']}, b={worst['batch']}, ctx={worst['context']}); "
            f"{len(result['summary']['over_goal'])} points over 1.10x",
            file=sys.stderr,
        )
    print(f"wrote {stem}.json" + ("" if part == "sweep" else " and .png"), file=sys.stderr)


PARTS = ("multi-token", "decode", "mixed", "sweep")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--out", type=Path, default=None, help="results folder (default bench/results)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-pool-gib", type=float, default=16.0, help="skip points needing more KV")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (slow to compile)")
    ap.add_argument("--no-graphs", action="store_true", help="eager timings only")
    ap.add_argument(
        "--part",
        action="append",
        choices=PARTS,
        help="what to run (repeatable; default multi-token, decode, mixed; sweep alone"
        " writes kernel-sweep-<device>.json)",
    )
    ap.add_argument(
        "--configs", nargs="+", choices=[c.name for c in CONFIGS], help="head shapes (default all)"
    )
    args = ap.parse_args(argv)
    parts = args.part or ["multi-token", "decode", "mixed"]
    if "sweep" in parts and len(parts) > 1:
        ap.error("--part sweep runs alone")
    configs = [c for c in CONFIGS if not args.configs or c.name in args.configs]

    if args.dry_run:
        out_dir = args.out or Path(tempfile.mkdtemp(prefix="kernel-bench-"))
        bench = Bench(torch.device("cpu"), torch.float32, 16, 2, 1 << 30, dry=True)
        cfgs = [HeadConfig(c.name, c.heads // 8 or 1, max(1, c.kv_heads // 8), 32) for c in configs]
        for cfg in cfgs:
            if "multi-token" in parts:
                bench.multi_token(cfg, 4, 8, [64, 128])
            if "decode" in parts:
                bench.decode(cfg, 2, [64, 128])
            if "sweep" in parts and _interpreting():
                bench.sweep(cfg, 1, [100])
        if "mixed" in parts:
            bench.mixed(cfgs[-1], 2, 32, 6, 64)
        save(bench, "cpu-dry-run", out_dir, "sweep" if "sweep" in parts else "")
        return 0
    if not torch.cuda.is_available():
        print(
            "bench.kernel needs a CUDA GPU (none found); use --dry-run to check it on the CPU.",
            file=sys.stderr,
        )
        return 2
    out_dir = args.out or RESULTS
    bench = Bench(
        torch.device("cuda"),
        getattr(torch, args.dtype),
        args.block_size,
        args.iters,
        int(args.max_pool_gib * 2**30),
        dry=False,
        use_flex=not args.no_flex,
        graphs=not args.no_graphs,
    )
    name = torch.cuda.get_device_name()
    contexts = [1024, 2048, 4096, 8192, 16384]
    if "sweep" in parts:
        for cfg in configs:
            if cfg.heads == cfg.kv_heads:
                continue  # MHA decode fills the GPU without splits
            for batch in (1, 8, 64):
                print(f"{cfg.name}: sweep, decode batch {batch}", file=sys.stderr)
                bench.sweep(cfg, batch, [1024, 4096, 16384])
            save(bench, name, out_dir, "sweep")
        return 0
    for cfg in configs:
        if "multi-token" in parts:
            print(f"{cfg.name}: 32 x 8 query tokens", file=sys.stderr)
            bench.multi_token(cfg, 32, 8, contexts)
        if "decode" in parts:
            for batch in DECODE_BATCHES:
                print(f"{cfg.name}: decode batch {batch}", file=sys.stderr)
                bench.decode(cfg, batch, contexts)
        if "mixed" in parts:
            bench.mixed(cfg, 4, 512, 60, 2048)
        save(bench, name, out_dir)  # after each config: a cut-short run still leaves results
    return 0


if __name__ == "__main__":
    sys.exit(main())
