"""Structured output: how often replies are valid, and what the grammar costs a decode step.

    python -m bench.grammar            # writes bench/results/grammar-<device>.json and .png

(a) Validity: `--generations` replies over the five schemas of bench/lib/schemas.py (sampled
at 0.7-1.0 with seeds, one `engine.run`), each checked with `jsonschema`. (b) The cost per
decode step at batch 1, 4 and 16: the same prompts unguided, guided with the mask fill
overlapped with the forward (the engine's way) and guided serially; only steps where all
rows decode within their first `--window` reply tokens count; medians over `--rounds`
interleaved rounds. Beside it the mask work alone: llguidance's fill of B rows, and applying
the masks to B rows of logits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.lib.common import RESULTS, device_slug, environment, write_json
from bench.lib.schemas import SCHEMAS
from engine import Engine, EngineConfig, Guide, SamplingParams, Turn
from engine.guide import StepMask, plan_masks
from engine.request import Status
from engine.sampler import apply_mask

NAMES = list(SCHEMAS)


def guide(name: str) -> Guide:
    return Guide("json_schema", json.dumps(SCHEMAS[name][1]))


def prompt(engine: Engine, name: str) -> list[int]:
    msgs = [{"role": "user", "content": SCHEMAS[name][0]}]
    return engine.tokenizer.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def validity(engine: Engine, n: int, max_tokens: int) -> dict[str, Any]:
    import jsonschema

    turns, names = [], []
    for i in range(n):
        name = NAMES[i % len(NAMES)]
        sp = SamplingParams(
            max_tokens=max_tokens, temperature=0.7 + 0.1 * (i % 4), seed=i, guide=guide(name)
        )
        turns.append(Turn(f"valid-{i}", prompt(engine, name), sp))
        names.append(name)
    start = time.perf_counter()
    results = engine.run(turns)
    elapsed = time.perf_counter() - start
    per: dict[str, dict[str, int]] = {name: {"valid": 0, "total": 0} for name in NAMES}
    failures, replies = [], []
    for name, r in zip(names, results, strict=True):
        ids = [t for t in r.token_ids if t not in engine.stop_token_ids]
        text = engine.tokenizer.decode(ids)
        per[name]["total"] += 1
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[name][1])
            per[name]["valid"] += 1
        except (ValueError, jsonschema.ValidationError) as e:
            failures.append({"schema": name, "finish": r.finish_reason, "text": text,
                             "error": str(e)[:200]})  # fmt: skip
        replies.append((name, ids))
    for r in results:
        engine.free(r.conversation_id)
    return {
        "generations": n,
        "valid": sum(p["valid"] for p in per.values()),
        "per_schema": per,
        "finish_stop": sum(r.finish_reason == "stop" for r in results),
        "reply_tokens_mean": round(sum(len(i) for _, i in replies) / n, 1),
        "seconds": round(elapsed, 2),
        "failures": failures[:5],
        "_replies": replies,
    }


def step_times(engine: Engine, b: int, mode: str, window: int, tag: str) -> list[float]:
    """Times of the steps in which all b rows decode within their first `window` tokens."""
    turns = []
    for i in range(b):
        name = NAMES[i % len(NAMES)]
        if mode == "unguided":
            sp = SamplingParams(max_tokens=window + 1, ignore_eos=True)
        else:
            sp = SamplingParams(max_tokens=4 * window, guide=guide(name))
        turns.append(Turn(f"{tag}-{i}", prompt(engine, name), sp))
    engine.runner.overlap_masks = mode != "guided-serial"
    reqs = [engine.submit(t) for t in turns]
    times = []
    while any(r.status != Status.FINISHED for r in reqs):
        decoding = all(
            r.status == Status.RUNNING and 1 <= len(r.output) < window and not r.in_prefill
            for r in reqs
        )
        start = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - start)
    for t in turns:
        engine.free(t.conversation_id)
    engine.runner.overlap_masks = True
    return times


def step_cost(engine: Engine, sizes: list[int], rounds: int, window: int) -> list[dict]:
    modes = ["unguided", "guided", "guided-serial"]
    seen: dict[tuple[int, str], list[float]] = {(b, m): [] for b in sizes for m in modes}
    step_times(engine, 4, "guided", window, "warm")  # tokenizer, first masks, caches
    for r in range(rounds):
        for b in sizes:
            for m in modes:
                seen[(b, m)] += step_times(engine, b, m, window, f"r{r}-{b}-{m}")
    rows = []
    for b in sizes:
        med = {m: statistics.median(seen[(b, m)]) * 1e3 for m in modes}
        rows.append(
            {
                "batch": b,
                "steps": {m: len(seen[(b, m)]) for m in modes},
                "unguided_ms": round(med["unguided"], 2),
                "guided_ms": round(med["guided"], 2),
                "guided_serial_ms": round(med["guided-serial"], 2),
                "overhead_pct": round(100 * (med["guided"] / med["unguided"] - 1), 1),
                "overhead_serial_pct": round(100 * (med["guided-serial"] / med["unguided"] - 1), 1),
            }
        )
    return rows


def mask_work(engine: Engine, replies: list[tuple[str, list[int]]], sizes: list[int]) -> list[dict]:
    """The mask work alone, replaying replies of (a): fill B rows, apply them to B logits."""
    guides = engine.guides
    vocab = engine.args.vocab_size
    out = []
    for b in sizes:
        fills, applies = [], []
        for start in range(0, len(replies) - b + 1, b):
            group = replies[start : start + b]
            matchers = [guides.matcher(guide(name)) for name, _ in group]
            steps = min(len(ids) for _, ids in group)
            for k in range(steps):
                p = plan_masks([(m, k, 0, ()) for m in matchers], guides.stops)
                t0 = time.perf_counter()
                job = guides.masks(p, overlap=False)
                mask: StepMask = job.result()
                t1 = time.perf_counter()
                logits = torch.zeros(b, vocab)
                t2 = time.perf_counter()
                apply_mask(logits, mask)
                t3 = time.perf_counter()
                fills.append(t1 - t0)
                applies.append(t3 - t2)
                for m, (_, ids) in zip(matchers, group, strict=True):
                    m.consume(ids[k])
        out.append(
            {
                "batch": b,
                "samples": len(fills),
                "fill_us": round(statistics.median(fills) * 1e6, 1),
                "fill_p90_us": round(sorted(fills)[int(0.9 * len(fills))] * 1e6, 1),
                "apply_us": round(statistics.median(applies) * 1e6, 1),
            }
        )
    return out


def plot(result: dict[str, Any], path: Path) -> Path:
    from bench.lib.plots import plt, save_fig

    rows = result["step_cost"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(rows))
    w = 0.27
    for i, (key, label, color) in enumerate(
        [
            ("unguided_ms", "unguided", "tab:gray"),
            ("guided_ms", "guided (fill overlapped)", "tab:green"),
            ("guided_serial_ms", "guided (fill before forward)", "tab:orange"),
        ]
    ):
        bars = ax.bar([j + (i - 1) * w for j in x], [r[key] for r in rows], w, label=label,
                      color=color)  # fmt: skip
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(list(x), [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("median decode step (ms)")
    ax.set_title("Engine step, all rows guided vs unguided", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    mw = result["mask_work"]
    bars = bx.bar([f"batch {m['batch']}" for m in mw], [m["fill_us"] for m in mw], 0.4,
                  label="fill (llguidance)", color="tab:blue")  # fmt: skip
    bx.bar_label(bars, fmt="%.0f", fontsize=7)
    bars = bx.bar([f"batch {m['batch']}" for m in mw], [m["apply_us"] for m in mw], 0.4,
                  bottom=[m["fill_us"] for m in mw], label="apply to logits",
                  color="tab:purple")  # fmt: skip
    bx.set_ylabel("median per step (µs)")
    v = result["validity"]
    bx.set_title(f"Mask work alone; valid replies: {v['valid']}/{v['generations']}", fontsize=10)
    bx.legend(fontsize=8)
    bx.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"Grammar-constrained decoding, {result['model']}, {result['environment']['device']}",
                 fontsize=10)  # fmt: skip
    return save_fig(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    ap.add_argument("--generations", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--sizes", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--window", type=int, default=16, help="reply tokens per timed turn")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    engine = Engine(EngineConfig(model=args.model, device=args.device))
    valid = validity(engine, args.generations, args.max_tokens)
    replies = valid.pop("_replies")
    result = {
        "model": args.model,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "validity": valid,
        "step_cost": step_cost(engine, sizes, args.rounds, args.window),
        "mask_work": mask_work(engine, replies, sizes),
        "environment": environment(engine.device),
    }
    engine.close()
    out = args.out or RESULTS / f"grammar-{device_slug(result['environment']['device'])}.json"
    write_json(out, result, indent=2)
    png = plot(result, out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("validity", "step_cost", "mask_work")}, indent=2))
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
