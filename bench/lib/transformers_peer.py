"""The transformers peer of `bench.peer_cpu` (`--peer transformers`): the engine's cache
modes in process against transformers' continuous batching, round by round (each round the
next turn of every conversation, every reply exactly `--output` tokens). Engine rows: roomy
pools (everything fits the first tier) or tight ones (about half the idle history);
`generate_batch` keeps nothing between calls, so each round re-prefills every history.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from bench.lib import workload as wl
from bench.lib.pools import history_chunks


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


def rounds(convs: list[wl.Conversation]) -> list[list[tuple[str, wl.TurnSpec]]]:
    n = max(len(c.turns) for c in convs)
    return [[(c.id, c.turns[k]) for c in convs if k < len(c.turns)] for k in range(n)]


def run_engine(setup: Setup, convs, args, pools: dict[str, tuple[int, int]]) -> dict[str, Any]:
    from engine import Engine, EngineConfig, SamplingParams, Turn

    gpu, cpu = pools[setup.pools]
    cpu = cpu if setup.cache_mode == "pensieve" else 0
    engine = Engine(EngineConfig(
        model=args.model, device="cpu", dtype="float32", gpu_cache_chunks=gpu,
        cpu_cache_chunks=cpu, cache_mode=setup.cache_mode, eviction=setup.eviction,
        max_batch_tokens=args.max_batch_tokens,
    ))  # fmt: skip
    try:
        sp = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
        engine.run([Turn("warmup", list(convs[0].turns[0].prompt[:64]), sp)])  # one-time costs
        engine.free("warmup")
        keys = ("cached_tokens", "swapped_in_tokens", "recomputed_tokens")
        totals = dict.fromkeys((*keys, "generated"), 0)
        round_s = []
        t0 = time.perf_counter()
        for batch in rounds(convs):
            t = time.perf_counter()
            results = engine.run([Turn(cid, list(spec.prompt), sp) for cid, spec in batch])
            round_s.append(time.perf_counter() - t)
            for r in results:
                totals["generated"] += len(r.token_ids)
                for key in keys:
                    totals[key] += getattr(r.stats, key)
        wall = time.perf_counter() - t0
        counters = engine.snapshot().counters
    finally:
        engine.close()
    return {"name": setup.name, "setup": asdict(setup), "gpu_cache_chunks": gpu,
            "cpu_cache_chunks": cpu, "wall_s": wall, "round_s": round_s,
            "tokens_per_s": totals["generated"] / wall, **totals,
            "suspensions": counters.suspensions,
            "swapped_out_tokens": counters.swapped_out_tokens}  # fmt: skip


def run_generate_batch(convs, args) -> dict[str, Any]:
    """transformers' continuous batching; each round re-prefills every whole history."""
    import torch
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    from engine.model.loader import model_dir

    model = AutoModelForCausalLM.from_pretrained(model_dir(args.model), dtype=torch.float32).eval()
    gen = GenerationConfig(max_new_tokens=args.output, do_sample=False, eos_token_id=None,
                           min_new_tokens=args.output,  # like ignore_eos: every reply as long
                           pad_token_id=0)  # fmt: skip
    longest, page = max(c.context_lens()[-1] for c in convs), 256
    cb = ContinuousBatchingConfig(
        page_size=page, num_blocks=len(convs) * (-(-longest // page) + 1),
        max_batch_tokens=args.max_batch_tokens, use_cuda_graph=False,  # none on the CPU
    )  # fmt: skip

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
    return {"name": "hf generate_batch", "wall_s": wall, "round_s": round_s,
            "tokens_per_s": generated / wall, "generated": generated,
            "prefilled_tokens": prefilled}  # fmt: skip


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
    out: dict[str, Any] = {k: {"ratio": r, "goal": g, "met": None if r is None else r >= g}
                           for k, (r, g) in checks.items()}  # fmt: skip
    if "pensieve" in rows and "pensieve-lru" in rows:
        p, lru = rows["pensieve"]["recomputed_tokens"], rows["pensieve-lru"]["recomputed_tokens"]
        out["pensieve_recomputes_less_than_lru"] = {"pensieve": p, "lru": lru, "met": p < lru}
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'system':<20}{'tok/s':>8}{'wall s':>8}{'cached':>9}{'swapped':>9}{'recomp':>9}"
    return "\n".join([head, "-" * len(head)] + [
        f"{r['name']:<20}{r['tokens_per_s']:>8.1f}{r['wall_s']:>8.1f}"
        f"{r.get('cached_tokens', '-'):>9}{r.get('swapped_in_tokens', '-'):>9}"
        f"{r.get('recomputed_tokens', r.get('prefilled_tokens', '-')):>9}" for r in rows
    ])  # fmt: skip


def compare(args, convs: list[wl.Conversation]) -> dict[str, Any]:
    """Every engine setup (`--only`: some), then transformers' (unless `--no-peer`)."""
    total = history_chunks(convs)
    longest = max(-(-c.context_lens()[-1] // 32) for c in convs)
    tight = max(int(total * args.tight), 2 * longest + 2)
    # tight: half the history cannot stay in the first tier and some cannot stay at all, so
    # the eviction policy decides what is recomputed
    pools = {"roomy": (total + 64, total + 64), "tight": (tight, int(total * args.tight_cpu))}
    print(f"idle history {total} chunks; pools (first, second tier): {pools}")
    only = set(args.only.split(",")) if args.only else None
    rows = []
    for setup in SETUPS:
        if not only or setup.name in only:
            rows.append(run_engine(setup, convs, args, pools))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    if not args.no_peer and (not only or "hf generate_batch" in only):
        rows.append(run_generate_batch(convs, args))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    return {
        "pools": {"history_chunks": total, **{k: list(v) for k, v in pools.items()}},
        "results": rows,
        "note": "tight pools: first tier holds --tight of the idle history, second --tight-cpu",
        "goals": goals({r["name"]: r for r in rows}),
    }
