"""The bundled model's decode step with the GGUF's own 4-bit linears against dequantized
bfloat16 ones (oneDNN-packed, the CPU default), A/B interleaved on a shared machine.

    python -m bench.int4_weights                      # 8 rows (and 1, 16), 2 threads
    python -m bench.int4_weights --rows 8 --rounds 40 --threads 1

Both loaded as the engine's CPU backend loads them (`weights=bfloat16` and `weights=gguf`,
packed linears). A round times `--steps` whole decode steps (attention over `--context`
cached tokens a row) of each in turn; figures: the median of the rounds, their spread, and
the median of the rounds' paired ratios int4 / dense. The weights' resident size counts each
tensor once. Results: bench/results/int4_weights_<commit>_<threads>t.json and .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import kernels
from bench.lib.common import RESULTS, environment, git_commit
from engine.backends.local import Local
from engine.types import EngineConfig

ARMS = {"bfloat16 dense": "bfloat16", "gguf int4": "gguf"}


def weight_bytes(model: torch.nn.Module) -> int:
    seen: dict[int, int] = {}
    for m in model.modules():
        tensors = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        tensors += [t for t in (getattr(m, "packed", None),) if isinstance(t, torch.Tensor)]
        for t in tensors:
            if t.is_mkldnn:  # oneDNN's packed layout is opaque: its logical size
                seen[id(t)] = t.numel() * t.element_size()
            else:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def decode_step(model, rows: int, context: int, block: int = 32):
    """A closure running one decode step of `rows` rows, each at `context` cached tokens."""
    a = model.args
    n = -(-(context + 1) // block)
    shape = (rows * n, block, a.n_kv_heads, a.head_dim)
    zeros = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(2 * a.n_layers)]
    pools = list(zip(zeros[::2], zeros[1::2], strict=True))
    tables = [list(range(r * n, (r + 1) * n)) for r in range(rows)]
    meta = kernels.AttentionMetadata.build([1] * rows, [context] * rows, tables, "cpu")
    ids = torch.randint(0, a.vocab_size, (rows,))
    pos = torch.full((rows,), context)
    slots = torch.tensor([t[context // block] * block + context % block for t in tables])
    out = torch.arange(rows)
    return lambda: model(ids, pos, pools, meta, slots, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    models = {
        arm: Local(EngineConfig(device="cpu", dtype="bfloat16", weights=w)).model
        for arm, w in ARMS.items()
    }
    sizes = {arm: weight_bytes(m) / 2**20 for arm, m in models.items()}
    result: dict = {"settings": vars(args), "weights_mib": sizes, "step_ms": {}}
    for rows in args.rows:
        steps = {arm: decode_step(m, rows, args.context) for arm, m in models.items()}
        times: dict[str, list[float]] = {arm: [] for arm in models}
        for step in steps.values():  # warm: oneDNN's and the kernel's first calls
            step()
        for _ in range(args.rounds):
            for arm, step in steps.items():  # interleaved: both see the same load
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step()
                times[arm].append((time.perf_counter() - t0) / args.steps * 1e3)
        result["step_ms"][rows] = {
            arm: {"median": statistics.median(t), "min": min(t), "max": max(t), "rounds": t}
            for arm, t in times.items()
        }
        # Paired by round (both arms under the same load): the steadier figure
        dense, int4 = times.values()
        ratios = [b / a for a, b in zip(dense, int4, strict=True)]
        result["step_ms"][rows]["int4_over_dense"] = statistics.median(ratios)
        print(rows, json.dumps({k: v for k, v in result["step_ms"][rows].items() if k in ARMS}))
        print(rows, "int4 / dense, median of paired rounds:", f"{statistics.median(ratios):.3f}")
    result["environment"] = environment("cpu")
    print("weights MiB", json.dumps(sizes))
    stem = RESULTS / f"int4_weights_{git_commit()[:7]}_{args.threads}t"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, stem.with_suffix(".png"))


def plot(result: dict, path) -> None:
    from bench.lib.plots import plt

    fig, (ax, rx) = plt.subplots(1, 2, figsize=(10, 4))
    steps = result["step_ms"]
    rows = list(steps)
    for arm in ARMS:
        label = f"{arm} ({result['weights_mib'][arm]:.0f} MiB weights)"
        ax.plot(rows, [steps[r][arm]["median"] for r in rows], "o-", label=label)
    ax.set(xlabel="rows (decoding turns)", ylabel="decode step, ms (median of rounds)")
    ax.legend()
    rx.bar([str(r) for r in rows], [steps[r]["int4_over_dense"] for r in rows])
    rx.axhline(1.0, color="k", lw=0.8)
    rx.set(xlabel="rows", ylabel="int4 / dense step time (median of paired rounds)")
    t = result["settings"]["threads"]
    fig.suptitle(f"SmolLM2-135M decode step: GGUF int4 vs bfloat16 dense, {t} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
