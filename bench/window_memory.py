"""KV bytes a long Gemma 3 conversation holds: every layer's chunks (what the engine keeps)
against only the chunks each sliding layer can still read (NOT implemented: a figure of what
that would save).

    python -m bench.window_memory                       # gemma-3-1b and gemma-3-4b, 8k and 32k
    python -m bench.window_memory --tokens 4096 131072

Arithmetic over the model's shape, no model is run. A conversation of L tokens holds
ceil(L / chunk) chunks in every layer. A later query (position L or more) of a sliding layer
reads no key before L - window + 1, so that layer needs only the held chunks from there on;
a global layer needs every chunk. bfloat16 KV (2 bytes), K and V.
Results: bench/results/window-memory.json.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from bench.lib.common import ROOT, git_commit
from engine.model.shapes import DUMMY_SHAPES, ModelArgs


@dataclass(frozen=True)
class Held:
    model: str
    tokens: int
    window: int
    sliding_layers: int
    global_layers: int
    all_layers_bytes: int  # what the engine holds (implemented)
    window_only_bytes: int  # sliding layers keep only their window's chunks (NOT implemented)
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
        name,
        tokens,
        window,
        sliding,
        args.n_layers - sliding,
        all_bytes,
        window_bytes,
        round(all_bytes / window_bytes, 2),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["gemma-3-1b", "gemma-3-4b"])
    p.add_argument("--tokens", nargs="+", type=int, default=[8192, 32768])
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "window-memory.json"))
    a = p.parse_args()
    rows = [held(m, DUMMY_SHAPES[m], t) for m in a.models for t in a.tokens]
    for r in rows:
        print(
            f"{r.model:12} {r.tokens:6} tokens: all layers {r.all_layers_bytes / 2**20:7.1f} MiB, "
            f"window only {r.window_only_bytes / 2**20:6.1f} MiB (not implemented), {r.ratio}x"
        )
    result = {
        "commit": git_commit(),
        "note": "window_only_bytes is NOT implemented: the engine keeps every layer's chunks",
        "kv_dtype": "bfloat16",
        "chunk_size": 32,
        "rows": [asdict(r) for r in rows],
    }
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
