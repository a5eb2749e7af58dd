"""Fused elementwise kernels (CUDA only): one decoder layer's elementwise work, fused against
unfused.

- unfused: `Block.forward`'s PyTorch code (residual add, RMSNorm, RoPE on q and k, SiLU * up)
  plus the Triton KV write;
- fused: `add_rms_norm` twice, `rope_write_kv`, `silu_mul` (`Block.forward_fused`).

Shapes SmolLM2-135M and Llama-2-13B (10 KV heads) at 1, 64, 256, 512 and 4096 tokens. Per
point `ms` (eager, launch included), `graph_ms` (device time per call from a CUDA graph of 10
calls), kernel launches, and GB/s of the fused path's minimum traffic. Writes
bench/results/fused-<device>.json; `--dry-run` runs tiny shapes on the CPU through the
Triton interpreter (numbers meaningless).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.lib.common import device_slug, write_json
from bench.lib.timing import eager_ms, graph_ms, header

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Shape:
    name: str
    dim: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int


SHAPES = [
    Shape("smollm2-135m", 576, 9, 3, 64, 1536),
    Shape("llama-2-13b-gqa10", 5120, 40, 10, 128, 13824),
]
TOKENS = [1, 64, 256, 512, 4096]


@dataclass
class Point:
    shape: str
    tokens: int
    method: str  # "unfused" | "fused"
    ms: float  # eager, median
    graph_ms: float | None  # device time per call from a CUDA graph
    launches: int | None  # kernels per call
    gbps: float  # the fused path's minimum traffic over graph_ms (else ms)


def min_bytes(s: Shape, t: int, elem: int) -> int:
    """Bytes the fused path must move: two add+norms (read x and delta, write both), q/k/v in
    and q out plus k/v to the pool, gate/up in and their product out."""
    norms = 2 * 4 * t * s.dim
    rope = 2 * t * (s.heads + 2 * s.kv_heads) * s.head_dim  # q, k, v in; q, k, v out
    mlp = 3 * t * s.inter
    return (norms + rope + mlp) * elem


class Layer:
    """One layer's elementwise inputs, and its elementwise work both ways."""

    def __init__(self, s: Shape, t: int, dtype: torch.dtype, device: torch.device) -> None:
        from engine.model.decoder import RMSNorm

        self.s, self.t = s, t
        g = torch.Generator(device=device).manual_seed(0)

        def randn(*shape):
            return torch.randn(*shape, generator=g, device=device).to(dtype)

        self.x, self.delta, self.attn_out = randn(t, s.dim), randn(t, s.dim), randn(t, s.dim)
        self.qkv = randn(t, (s.heads + 2 * s.kv_heads) * s.head_dim)
        self.gate_up = randn(t, 2 * s.inter)
        pos = torch.arange(t, device=device) * 7 % 4096
        inv = 1.0 / (10000.0 ** (torch.arange(0, s.head_dim, 2, device=device) / s.head_dim))
        emb = torch.cat([pos[:, None] * inv[None, :]] * 2, dim=-1)
        self.cos, self.sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]
        block = 32
        blocks = -(-t // block) + 1
        self.k_cache = torch.zeros(
            blocks, block, s.kv_heads, s.head_dim, dtype=dtype, device=device
        )
        self.v_cache = torch.zeros_like(self.k_cache)
        perm = torch.randperm(blocks * block, generator=g.manual_seed(1), device=device)
        self.slots = perm[:t].contiguous()
        self.norm1 = RMSNorm(s.dim, 1e-5).to(dtype).to(device)
        self.norm2 = RMSNorm(s.dim, 1e-5).to(dtype).to(device)

    def unfused(self) -> None:
        """Block.forward's elementwise code (engine/model/decoder.py), in its order."""
        from engine.model.decoder import rotate_half
        from kernels import write_kv

        s, t = self.s, self.t
        h = self.x + self.delta
        self.norm1(h)
        q, k, v = self.qkv.split(
            [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1
        )
        q = q.view(t, s.heads, s.head_dim)
        k = k.view(t, s.kv_heads, s.head_dim)
        v = v.view(t, s.kv_heads, s.head_dim)
        q = q * self.cos + rotate_half(q) * self.sin
        k = k * self.cos + rotate_half(k) * self.sin
        write_kv(self.k_cache, self.v_cache, k, v, self.slots, backend="triton")
        h = h + self.attn_out
        self.norm2(h)
        gate, up = self.gate_up.chunk(2, dim=-1)
        F.silu(gate) * up

    def fused(self) -> None:
        """Block.forward_fused's elementwise kernels."""
        import kernels

        s = self.s
        h, _ = kernels.add_rms_norm(self.x, self.delta, self.norm1.weight, self.norm1.eps)
        kernels.rope_write_kv(
            self.qkv, self.cos, self.sin, self.k_cache, self.v_cache, self.slots,
            s.heads, s.kv_heads, s.head_dim,
        )  # fmt: skip
        kernels.add_rms_norm(h, self.attn_out, self.norm2.weight, self.norm2.eps)
        kernels.silu_mul(self.gate_up)


def launches(fn: Callable[[], object]) -> int:
    """CUDA kernels one call launches, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")


def run(shapes, tokens, dtype, device, iters: int) -> list[Point]:
    cuda = device.type == "cuda"
    points = []
    for s in shapes:
        for t in tokens:
            layer = Layer(s, t, dtype, device)
            nbytes = min_bytes(s, t, layer.x.element_size())
            for method, fn in (("unfused", layer.unfused), ("fused", layer.fused)):
                with torch.inference_mode():
                    ms = eager_ms(fn, iters, cuda)
                    g = graph_ms(fn, iters) if cuda else None
                    n = launches(fn) if cuda else None
                p = Point(s.name, t, method, ms, g, n, nbytes / ((g or ms) * 1e-3) / 1e9)
                points.append(p)
                graphed = f" graph {g:8.4f} ms" if g is not None else ""
                print(
                    f"  {s.name:<18} T={t:<5} {method:<8} {ms:9.4f} ms{graphed}"
                    f" {n if n is not None else '-':>4} launches {p.gbps:8.1f} GB/s",
                    file=sys.stderr,
                )
            if cuda:
                torch.cuda.empty_cache()
    return points


def summarize(points: list[Point]) -> list[dict]:
    """Unfused / fused per shape and token count, eager and graph."""
    by = {(p.shape, p.tokens, p.method): p for p in points}
    rows = []
    for (shape, t, method), u in by.items():
        f = by.get((shape, t, "fused"))
        if method != "unfused" or f is None:
            continue
        row = {"shape": shape, "tokens": t, "eager_speedup": u.ms / f.ms}
        if u.graph_ms and f.graph_ms:
            row["graph_speedup"] = u.graph_ms / f.graph_ms
        if u.launches is not None:
            row["launches"] = f"{u.launches} -> {f.launches}"
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, Triton interpreter")
    ap.add_argument("--out", type=Path, default=None, help="results folder (default bench/results)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="bfloat16")
    ap.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    args = ap.parse_args(argv)
    if args.dry_run:
        # Triton reads this when a kernel is defined: before kernels/ imports triton.
        os.environ["TRITON_INTERPRET"] = "1"
        out_dir = args.out or Path(tempfile.mkdtemp(prefix="fused-bench-"))
        shapes = [Shape("tiny", 96, 3, 1, 32, 80)]
        points = run(shapes, [1, 5], torch.float32, torch.device("cpu"), 2)
        name = "cpu-dry-run"
    else:
        if not torch.cuda.is_available():
            print("bench.fused needs a CUDA GPU (none found); use --dry-run.", file=sys.stderr)
            return 2
        out_dir = args.out or RESULTS
        name = torch.cuda.get_device_name()
        points = run(
            SHAPES, args.tokens, getattr(torch, args.dtype), torch.device("cuda"), args.iters
        )
    summary = summarize(points)
    device = torch.device("cuda") if name != "cpu-dry-run" else None
    dtype = "float32" if args.dry_run else args.dtype
    result = {
        **header(name, device, dtype, args.iters),
        "summary": summary,
        "points": [asdict(p) for p in points],
    }
    path = write_json(out_dir / f"fused-{device_slug(name)}.json", result)
    for row in summary:
        extra = f", graph {row['graph_speedup']:.2f}x" if "graph_speedup" in row else ""
        launched = f", launches {row['launches']}" if "launches" in row else ""
        print(
            f"{row['shape']:<18} T={row['tokens']:<5} unfused/fused: eager {row['eager_speedup']:.2f}x"
            + extra
            + launched
        )
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
