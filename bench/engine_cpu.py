"""Engine throughput on the CPU over multi-turn conversations, against transformers' own batching.

    python -m bench.engine_cpu            # writes bench/results/engine_cpu.json and .png

The same conversations (ShareGPT, fixed seed) are served round by round: each round submits
the next turn of every conversation in one `engine.run` call, and every reply is exactly
`--output` tokens long (`ignore_eos`). Compared, in generated tokens per second:

- the engine in `pensieve`, `gpu` (first tier only) and `stateless` modes, and the `lru`
  eviction policy; "roomy" pools keep every conversation in the first tier, "tight" ones
  hold about half of the idle history there;
- transformers' continuous batching (`generate_batch`), which keeps nothing between calls,
  so each round re-prefills every conversation's whole history.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.lib import workload as wl
from bench.lib.common import RESULTS, environment
from bench.lib.pools import history_chunks, model_args
from bench.lib.samples import load_tokenizer, read_sample


@dataclass
class Setup:
    name: str
    cache_mode: str = "pensieve"
    eviction: str = "pensieve"
    pools: str = "roomy"  # "roomy": everything fits the first tier; "tight": about half


SETUPS = [
    Setup("stateless", cache_mode="stateless"),
    Setup("pensieve (roomy)"),
    Setup("pensieve", pools="tight"),
    Setup("gpu", cache_mode="gpu", pools="tight"),
    Setup("pensieve-lru", eviction="lru", pools="tight"),
]


def conversations(args, tokenizer, max_context: int) -> list[wl.Conversation]:
    if args.sample_file is not None:
        pool, _ = read_sample(args.sample_file)
    else:
        pool = wl.load_sharegpt(tokenizer).conversations
    convs = wl.sample(
        pool,
        args.conversations,
        args.seed,
        context_cap=min(args.context_cap, max_context),
        max_output=args.output,
        min_turns=args.turns,
        max_turns=args.turns,
        min_context=args.min_context,
    )
    return wl.fixed_replies(convs, args.output)


def rounds(convs: list[wl.Conversation]) -> list[list[tuple[str, wl.TurnSpec]]]:
    n = max(len(c.turns) for c in convs)
    return [[(c.id, c.turns[k]) for c in convs if k < len(c.turns)] for k in range(n)]


def run_engine(setup: Setup, convs, args, pools: dict[str, tuple[int, int]]) -> dict[str, Any]:
    from engine import Engine, EngineConfig, SamplingParams, Turn

    gpu, cpu = pools[setup.pools]
    engine = Engine(
        EngineConfig(
            model=args.model,
            device="cpu",
            dtype="float32",
            gpu_cache_chunks=gpu,
            cpu_cache_chunks=cpu if setup.cache_mode == "pensieve" else 0,
            cache_mode=setup.cache_mode,
            eviction=setup.eviction,
            max_batch_tokens=args.max_batch_tokens,
        )
    )
    try:
        sp = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
        engine.run([Turn("warmup", list(convs[0].turns[0].prompt[:64]), sp)])  # one-time costs
        engine.free("warmup")
        totals = dict.fromkeys(
            ("cached_tokens", "swapped_in_tokens", "recomputed_tokens", "generated"), 0
        )
        round_s = []
        t0 = time.perf_counter()
        for batch in rounds(convs):
            t = time.perf_counter()
            results = engine.run([Turn(cid, list(spec.prompt), sp) for cid, spec in batch])
            round_s.append(time.perf_counter() - t)
            for r in results:
                totals["generated"] += len(r.token_ids)
                for key in ("cached_tokens", "swapped_in_tokens", "recomputed_tokens"):
                    totals[key] += getattr(r.stats, key)
        wall = time.perf_counter() - t0
        counters = engine.snapshot().counters
    finally:
        engine.close()
    return {
        "name": setup.name,
        "setup": asdict(setup),
        "gpu_cache_chunks": gpu,
        "cpu_cache_chunks": cpu if setup.cache_mode == "pensieve" else 0,
        "wall_s": wall,
        "round_s": round_s,
        "tokens_per_s": totals["generated"] / wall,
        **totals,
        "suspensions": counters.suspensions,
        "swapped_out_tokens": counters.swapped_out_tokens,
    }


def run_generate_batch(convs, args) -> dict[str, Any]:
    """transformers' continuous batching; each round re-prefills every whole history."""
    import torch
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    from engine.model.loader import model_dir

    model = AutoModelForCausalLM.from_pretrained(model_dir(args.model), dtype=torch.float32).eval()
    gen = GenerationConfig(
        max_new_tokens=args.output,
        min_new_tokens=args.output,  # like ignore_eos: every reply has the same length
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    longest = max(c.context_lens()[-1] for c in convs)
    page = 256
    cb = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=len(convs) * (-(-longest // page) + 1),
        max_batch_tokens=args.max_batch_tokens,
        use_cuda_graph=False,  # graphs pad every batch; there are none on the CPU anyway
    )

    def generate(inputs: list[list[int]]) -> list[list[int]]:
        out = model.generate_batch(
            inputs=inputs, generation_config=gen, continuous_batching_config=cb, warmup=False
        )
        by_id = sorted(out.values(), key=lambda o: int(o.request_id.rsplit("_", 1)[-1]))
        return [list(o.generated_tokens) for o in by_id]

    generate([list(convs[0].turns[0].prompt[:64])])  # one-time costs
    history = {c.id: [] for c in convs}
    generated, prefilled, round_s = 0, 0, []
    t0 = time.perf_counter()
    for batch in rounds(convs):
        inputs = [history[cid] + list(spec.prompt) for cid, spec in batch]
        t = time.perf_counter()
        outputs = generate(inputs)
        round_s.append(time.perf_counter() - t)
        for (cid, _), inp, out in zip(batch, inputs, outputs, strict=True):
            history[cid] = inp + out
            generated += len(out)
            prefilled += len(inp)
    wall = time.perf_counter() - t0
    return {
        "name": "hf generate_batch",
        "wall_s": wall,
        "round_s": round_s,
        "tokens_per_s": generated / wall,
        "generated": generated,
        "prefilled_tokens": prefilled,
    }


def goals(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    def ratio(a: str, b: str) -> float | None:
        if a in rows and b in rows and rows[b]["tokens_per_s"]:
            return rows[a]["tokens_per_s"] / rows[b]["tokens_per_s"]
        return None

    checks = {
        "stateless_over_generate_batch": (ratio("stateless", "hf generate_batch"), 3.0),
        "pensieve_roomy_over_stateless": (ratio("pensieve (roomy)", "stateless"), 2.0),
        "pensieve_tight_over_gpu": (ratio("pensieve", "gpu"), 1.3),
        "pensieve_tight_over_stateless": (ratio("pensieve", "stateless"), 2.5),
    }
    out: dict[str, Any] = {
        k: {"ratio": r, "goal": g, "met": None if r is None else r >= g}
        for k, (r, g) in checks.items()
    }
    if "pensieve" in rows and "pensieve-lru" in rows:
        p, lru = rows["pensieve"]["recomputed_tokens"], rows["pensieve-lru"]["recomputed_tokens"]
        out["pensieve_recomputes_less_than_lru"] = {"pensieve": p, "lru": lru, "met": p < lru}
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'system':<20}{'tok/s':>8}{'wall s':>8}{'cached':>9}{'swapped':>9}{'recomp':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['name']:<20}{r['tokens_per_s']:>8.1f}{r['wall_s']:>8.1f}"
            f"{r.get('cached_tokens', '-'):>9}{r.get('swapped_in_tokens', '-'):>9}"
            f"{r.get('recomputed_tokens', r.get('prefilled_tokens', '-')):>9}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.engine_cpu", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--output", type=int, default=16, help="tokens generated per turn")
    ap.add_argument("--context-cap", type=int, default=768)
    ap.add_argument("--min-context", type=int, default=400)
    ap.add_argument("--tight", type=float, default=0.5, help="first tier / idle history (tight)")
    ap.add_argument(
        "--tight-cpu", type=float, default=0.3, help="second tier / idle history (tight)"
    )
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: OpenMP threads spin badly on a busy 2-core machine)",
    )
    ap.add_argument("--sample-file", type=Path, help="draw from this tokenized sample (JSON)")
    ap.add_argument("--only", help="comma-separated systems to run (default: all)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' generate_batch")
    ap.add_argument("--out", type=Path, default=RESULTS / "engine_cpu.json")
    args = ap.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = None if args.sample_file else load_tokenizer(args.model)
    convs = conversations(args, tokenizer, model_args(args.model).max_context)
    print(wl.format_summary(wl.summarize(convs)))
    total = history_chunks(convs)
    longest = max(-(-c.context_lens()[-1] // 32) for c in convs)
    tight = max(int(total * args.tight), 2 * longest + 2)
    # Tight: half the history cannot stay in the first tier, and some cannot stay at all, so
    # the eviction policy decides what is recomputed.
    pools = {"roomy": (total + 64, total + 64), "tight": (tight, int(total * args.tight_cpu))}
    print(f"idle history {total} chunks; pools (first, second tier): {pools}")

    only = set(args.only.split(",")) if args.only else None
    rows = []
    for setup in SETUPS:
        if only and setup.name not in only:
            continue
        rows.append(run_engine(setup, convs, args, pools))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    if not args.no_hf and (not only or "hf generate_batch" in only):
        rows.append(run_generate_batch(convs, args))
        print(table(rows[-1:]).splitlines()[-1], flush=True)

    by_name = {r["name"]: r for r in rows}
    result = {
        "benchmark": "engine_cpu",
        "settings": {**vars(args), "out": str(args.out), "torch_threads": torch.get_num_threads()},
        "environment": environment(),
        "workload": wl.summarize(convs),
        "pools": {"history_chunks": total, **{k: list(v) for k, v in pools.items()}},
        "results": rows,
        "note": "tight pools: first tier holds --tight of the idle history, second --tight-cpu",
        "goals": goals(by_name),
    }
    print(table(rows))
    print(json.dumps(result["goals"], indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    from bench.lib.plots import plot_bars

    png = plot_bars(
        rows,
        "tokens_per_s",
        "generated tokens / s",
        f"{args.model}, CPU: {len(convs)} conversations x {args.turns} turns, "
        f"{args.output} tokens per reply",
        args.out.with_suffix(".png"),
    )
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
