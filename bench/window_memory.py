"""KV bytes a long conversation holds, measured from a running engine: sliding layers keeping
only their window (engine/kv_layout.py) against keeping every layer, beside the arithmetic of
the model's shape.

    python -m bench.window_memory                  # gemma-3-1b, gpt-oss-20b, mistral-7b at 8k, 32k
    python -m bench.window_memory --real gemma-3-270m --real-tokens 2048 8192
                                                         # real weights on the CPU too

An engine runs one conversation of N tokens (a prompt of N - 1, one token sampled: a model
with N positions holds N - 1) and the bytes
are its pages on the GPU tier times a page's bytes. The shapes run on a simulated H100 (the
real cache and scheduler, no weights; bfloat16 KV); `--real` models run on this CPU with
their weights (float32 KV). The arithmetic: a sliding layer past the window needs only the
chunks from (N - window + 1)'s on, a full layer every chunk (Mistral 7B v0.1: every layer
slides, and a chunk the window left holds nothing); the engine keeps one chunk more
at most (the window of the last chunk's start: a recompute after chunks read back from disk
starts there) and pads a group's page where the sliding layers do not fill it (Gemma 3 1B:
22 sliding layers in pages of 4). "Conversations held": a 40 GiB tier (the paper's) over the
measured bytes. Results: bench/results/window-memory.json and .png.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from bench.lib.common import RESULTS, environment
from engine.model.shapes import DUMMY_SHAPES, ModelArgs

TIER_GIB = 40  # the paper's GPU KV tier


@dataclass(frozen=True)
class Held:
    """The arithmetic of the shape: what each layer can still read."""

    model: str
    tokens: int
    window: int
    sliding_layers: int
    global_layers: int
    all_layers_bytes: int
    window_only_bytes: int
    ratio: float


def held(name: str, args: ModelArgs, tokens: int, chunk: int = 32, dtype_bytes: int = 2) -> Held:
    per_chunk_layer = 2 * chunk * args.n_kv_heads * args.head_dim * dtype_bytes  # K and V
    chunks = -(-tokens // chunk)
    windows = [args.window(i) for i in range(args.n_layers)]
    sliding = sum(w is not None for w in windows)
    window = args.sliding_window or 0
    # Held chunks that overlap positions tokens - window + 1 .. tokens - 1: the keys a later
    # query can still read (none before them is ever read again).
    local = (tokens - 1) // chunk - max(0, tokens - window + 1) // chunk + 1
    all_bytes = args.n_layers * chunks * per_chunk_layer
    window_bytes = (args.n_layers - sliding) * chunks * per_chunk_layer
    window_bytes += sliding * local * per_chunk_layer
    return Held(
        name, tokens, window, sliding, args.n_layers - sliding, all_bytes, window_bytes,
        round(all_bytes / window_bytes, 2),
    )  # fmt: skip


def measured(model: str, tokens: int, savings: bool, device: str) -> dict:
    """Bytes one conversation of `tokens` positions holds in an engine's GPU tier."""
    from engine import Engine, EngineConfig, SamplingParams, Turn

    config = EngineConfig(
        model=model,
        device=device,
        window_savings=savings,
        max_batch_tokens=8192,
        gpu_cache_chunks=4 * (-(-tokens // 32)) + 64,
        cpu_cache_chunks=0,
    )
    e = Engine(config)
    prompt = [100 + i % 20000 for i in range(tokens - 1)]
    e.run([Turn("w", prompt, SamplingParams(max_tokens=1, ignore_eos=True))])
    t = e.cache.find("w")
    layout, cs = e.pool.layout, e.cache.chunk_size
    page = layout.page_bytes(e.pool.bytes_per_chunk)
    full = sum(1 for c in t.chunks if c.gpu is not None)
    sliding = sum(len(c.gpu_win or ()) for c in t.chunks)
    e.close()
    return {
        "tokens": t.tokens,
        "chunk_size": cs,
        "page_bytes": page,
        "full_pages": full,
        "sliding_pages": sliding,
        "bytes": (full + sliding) * page,
        "full_layer_bytes": full * page,
        "sliding_layer_bytes": sliding * page,
    }


def row(model: str, tokens: int, device: str, dtype_bytes: int) -> dict:
    from engine.model.loader import model_args

    name = model.removeprefix("dummy:")
    args = DUMMY_SHAPES.get(name) or model_args(model)
    kept, every = (measured(model, tokens, s, device) for s in (True, False))
    arith = held(name, args, kept["tokens"], dtype_bytes=dtype_bytes)
    return {
        "model": name,
        "device": device,
        "tokens": tokens,
        "engine_window_bytes": kept["bytes"],
        "engine_every_layer_bytes": every["bytes"],
        "engine_ratio": round(every["bytes"] / kept["bytes"], 2),
        "arithmetic_window_bytes": arith.window_only_bytes,
        "arithmetic_every_layer_bytes": arith.all_layers_bytes,
        "arithmetic_ratio": arith.ratio,
        "window_vs_arithmetic": round(kept["bytes"] / arith.window_only_bytes, 3),
        "full_layer_bytes": kept["full_layer_bytes"],
        "sliding_layer_bytes": kept["sliding_layer_bytes"],
        "conversations_held_window": TIER_GIB * 2**30 // kept["bytes"],
        "conversations_held_every_layer": TIER_GIB * 2**30 // every["bytes"],
        "window": arith.window,
        "sliding_layers": arith.sliding_layers,
        "global_layers": arith.global_layers,
    }


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']}\n{r['tokens'] // 1024}k" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(rows)), 4))
    mib = 2**20
    ax.bar([i - 0.2 for i in x], [r["engine_every_layer_bytes"] / mib for r in rows], 0.4,
           label="every layer (engine)")  # fmt: skip
    ax.bar([i + 0.2 for i in x], [r["engine_window_bytes"] / mib for r in rows], 0.4,
           label="sliding layers: their window (engine)")  # fmt: skip
    ax.scatter([i + 0.2 for i in x], [r["arithmetic_window_bytes"] / mib for r in rows],
               color="black", marker="_", s=200, label="window, arithmetic", zorder=3)  # fmt: skip
    ax.set_xticks(list(x), labels)
    ax.set_yscale("log")
    ax.set_ylabel("KV of one conversation (MiB)")
    ax.set_title("Bytes per conversation, measured from the engine")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["gemma-3-1b", "gpt-oss-20b", "mistral-7b"])
    p.add_argument("--tokens", nargs="+", type=int, default=[8192, 32768])
    p.add_argument("--real", nargs="*", default=[], help="models run with weights on the CPU")
    p.add_argument("--real-tokens", nargs="+", type=int, default=[2048, 8192])
    p.add_argument("--out", default=str(RESULTS / "window-memory.json"))
    a = p.parse_args()
    rows = [row(f"dummy:{m}", t, "sim:h100", 2) for m in a.models for t in a.tokens]
    rows += [row(m, t, "cpu", 4) for m in a.real for t in a.real_tokens]
    for r in rows:
        print(
            f"{r['model']:14} {r['tokens']:6} tokens: every layer "
            f"{r['engine_every_layer_bytes'] / 2**20:7.1f} MiB, window "
            f"{r['engine_window_bytes'] / 2**20:6.1f} MiB ({r['engine_ratio']}x; "
            f"{r['window_vs_arithmetic']} of the arithmetic); a {TIER_GIB} GiB tier holds "
            f"{r['conversations_held_window']} against {r['conversations_held_every_layer']}"
        )
    result = {
        "benchmark": "window_memory",
        "environment": environment(),
        "note": "measured: an engine's GPU pages after one conversation (shapes on a "
        "simulated h100, bfloat16 KV; --real models on this CPU with weights, float32 KV)",
        "chunk_size": 32,
        "tier_gib": TIER_GIB,
        "rows": rows,
    }
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2, default=lambda o: asdict(o))
        f.write("\n")
    plot(rows, a.out.removesuffix(".json") + ".png")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
