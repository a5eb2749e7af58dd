"""Retention policies compared on an agent workload: simulated in virtual time, or real on the CPU.

    python -m bench.retention --shape 8b                  # Llama-3-8B shape, contexts to 100k
    python -m bench.retention --shape 13b                 # Llama-2-13B GQA10, contexts to 16k
    python -m bench.retention --shape 8b --memory 0.15,0.3 --modes tool-aware,ttl-pin
    python -m bench.retention --shape cpu --device cpu    # REAL: the bundled model, a small scale

Agent sessions (`bench/lib/agents.py`) over ShareGPT chats, on a simulated device with the
real scheduler, cache and policy (`--device cpu`: the real engine in real time). At equal
memory, how the cache keeps an agent's KV while its tool runs (`MODES`): `cost-t` (Cost/T,
tool calls not reported), `tool-aware` (each tool call reported: a waiting agent is worth
Cost over its tool's expected time still to come), `tool-hold` (and waiting agents held for
the p90 tool gap), `ttl-pin` (a fixed TTL pin per tool call, as Continuum, arXiv
2511.02230), `lru`, `hints` (tool-aware plus the tool's expected time as a pin, `ttl_s` 0 at
the end), `oracle` (a CPU tier that holds everything). Memory is swept as a share of every
context (`--memory`); then the memory where ttl-pin's p90 job time is 1.2x the oracle's is
searched and every mode run there: the goal is read at it.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.lib import agents as ag
from bench.lib import workload as wl
from bench.lib.common import RESULTS, ROOT, environment
from bench.lib.pools import BENCH_QUEUE, kv_bytes_per_chunk
from bench.lib.samples import read_sample
from bench.lib.virtual import replay

CHATS = ROOT / "bench" / "samples" / "gpu.json"  # tokenized ShareGPT: no tokenizer needed
GOAL_SLOWDOWN = 1.2  # the memory where ttl-pin's p90 job time is this times the oracle's
GOAL_TOLERANCE = 0.03  # found when ttl-pin is within this of it
GOAL_SEARCH = 4  # ttl-pin runs at most to find it
SAMPLE_S = 1.0  # virtual seconds between samples of the pinned bytes


FAILED = {k: float("nan") for k in ("jct_s_p50", "jct_s_p90", "ttft_s_p90", "pinned_gb_mean",
                                   "agent_recomputed_tokens", "chat_recomputed_tokens")}  # fmt: skip


@dataclass(frozen=True)
class Mode:
    name: str
    eviction: str = "pensieve"
    tools: bool = False  # the client reports each tool call: the job order, the tool value
    tool_value: bool = True  # a reported tool call values the waiting agent (else: order only)
    pin: str | None = None  # "ttl": a fixed TTL pin per tool call; "hint": the tool's mean
    holds: bool = False  # the server holds waiting agents (`EngineConfig.tool_holds`)
    oracle: bool = False  # a CPU tier that holds everything


MODES = {
    m.name: m
    for m in (
        Mode("cost-t"),
        Mode("tool-aware", tools=True),
        Mode("tool-hold", tools=True, holds=True),
        Mode("ttl-pin", tools=True, tool_value=False, pin="ttl"),
        Mode("lru", eviction="lru"),
        Mode("hints", tools=True, pin="hint"),
        Mode("oracle", tools=True, oracle=True),
    )
}


@dataclass(frozen=True)
class Shape:
    model: str
    spec: ag.AgentSpec
    agents: int
    agent_rate: float  # new agent sessions a second
    chats: int
    chat_rate: float
    think_s: float = 60.0  # the chats' users' mean think time


# The CPU shape's tools: the same kinds and spreads, a quarter as long (a run in real time)
CPU_TOOLS = tuple(replace(t, median_s=t.median_s / 4) for t in ag.TOOLS)

SHAPES = {
    # Llama 3 8B (128 KiB of KV a token): contexts to 100k tokens, 1-4k a tool result.
    "8b": Shape("dummy:llama-3-8b", ag.AgentSpec(), 16, 1 / 15, 300, 0.5),
    # 13B-GQA10, positions to 16k: tool results a quarter as long, sessions stop at 16k.
    "13b": Shape("dummy:llama-2-13b-gqa10",
                 ag.AgentSpec(task=(1000, 2000), output_scale=0.25, context_cap=16_000),
                 24, 1 / 10, 300, 0.5),
    # Real on the CPU: the bundled model, 6 agents of 6-10 steps to 1.5k tokens, 12 chats.
    "cpu": Shape("smollm2-135m-instruct",
                 ag.AgentSpec(steps=(6, 10), task=(200, 400), reply=(8, 24), answer=24,
                              output_scale=0.05, context_cap=1536, tools=CPU_TOOLS),
                 6, 1 / 4, 12, 0.5, 5.0),
}  # fmt: skip


# ---- one run ----------------------------------------------------------------------------------


def run(work: ag.Workload, mode: Mode, model: str, device: str, gpu: int, cpu: int,
        ttl_s: float, max_batch_tokens: int = 2048) -> dict[str, Any]:  # fmt: skip
    """One replay of the workload on its own simulated engine."""
    from engine import Engine, EngineConfig
    from engine.backends.local import serving_dtype
    from engine.types import Retention

    plans = work.agents + work.chats
    if mode.oracle:  # the same GPU tier: the same batches fit
        cpu = int(sum(_chunks(p.conversation) for p in plans) * 1.1) + 64
    dtype = serving_dtype(device)[0] if device == "cpu" else "bfloat16"
    engine = Engine(EngineConfig(
        model=model, device=device, dtype=dtype, gpu_cache_chunks=gpu,
        cpu_cache_chunks=cpu, eviction=mode.eviction, max_waiting=BENCH_QUEUE,
        max_batch_tokens=max_batch_tokens, tool_holds=mode.holds, tool_value=mode.tool_value,
    ))  # fmt: skip

    def retention(conversation: str, index: int) -> Retention | None:
        if mode.pin is None or not work.is_agent(conversation):
            return None
        if work.is_last(conversation, index):  # the answer: no tool call, so no pin
            # an agent that hints says its job is done: its chunks go first
            return Retention(ttl_s=0.0) if mode.pin == "hint" else None
        tool = work.tool_of(conversation, index)
        assert tool is not None
        return Retention(ttl_s=ttl_s if mode.pin == "ttl" else tool.mean_s)

    def ended(conversation: str, index: int, req) -> None:
        tool = work.tool_of(conversation, index) if mode.tools else None
        if tool is not None:
            engine.tools_called(req.state.id, [tool.name])

    pinned: list[int] = []
    next_sample = [0.0]

    def on_step() -> None:
        now = engine.now()
        if now >= next_sample[0]:
            u = engine.retainer.usage(now)
            pinned.append(u.gpu_bytes + u.cpu_bytes)
            next_sample[0] = now + SAMPLE_S

    t = time.perf_counter()
    try:
        records, span = replay(engine, plans, mode.name, retention=retention, on_end=ended,
                               on_step=on_step)  # fmt: skip
        counters = asdict(engine.snapshot().counters)
    finally:
        engine.close()
    return {**summarize(work, records), "mode": mode.name, "gpu_cache_chunks": gpu,
            "cpu_cache_chunks": cpu, "span_s": span,
            "pinned_gb_mean": sum(pinned) / len(pinned) / 2**30 if pinned else 0.0,
            "pinned_gb_max": max(pinned, default=0) / 2**30, "counters": counters,
            "real_s": time.perf_counter() - t}  # fmt: skip


def summarize(work: ag.Workload, records: list[wl.TurnRecord]) -> dict[str, Any]:
    """Job completion time per agent session (its first turn sent to its answer done), time
    to first token per agent step, recomputed and swapped-in tokens, chat latency."""
    agent = [r for r in records if work.is_agent(r.conversation)]
    chat = [r for r in records if not work.is_agent(r.conversation)]
    jobs, unfinished = [], 0
    for s in work.sessions:
        mine = [r for r in agent if r.conversation == s.id]
        if len(mine) < len(s.tools) or any(r.error for r in mine):
            unfinished += 1
            continue
        jobs.append(max(r.done_s for r in mine) - min(r.sent_s for r in mine))

    def total(rs: list[wl.TurnRecord], key: str) -> int:
        return sum(int(r.stats.get(key, 0)) for r in rs)

    def pct(xs: list[float], p: float) -> float:
        return wl.percentile(xs, p) if xs else float("nan")

    # where the agents' recompute comes from: the tool each turn waited on before it came
    by_tool: dict[str, int] = {}
    for r in agent:
        tool = work.tool_of(r.conversation, r.index - 1) if r.index else None
        name = tool.name if tool is not None else "task"
        by_tool[name] = by_tool.get(name, 0) + int(r.stats.get("recomputed_tokens", 0))
    ttft = [r.ttft_s for r in agent if not r.error]
    steps = [r.ttft_s for r in agent if not r.error and r.index > 0]  # after a tool returns
    chat_lat = [r.latency_s for r in chat if not r.error]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {
        "jobs": len(jobs), "unfinished": unfinished,
        "jct_s_p50": pct(jobs, 50), "jct_s_p90": pct(jobs, 90), "jct_s_mean": mean(jobs),
        "ttft_s_p50": pct(ttft, 50), "ttft_s_p90": pct(ttft, 90), "ttft_s_mean": mean(ttft),
        "step_ttft_s_p90": pct(steps, 90),
        "agent_recomputed_tokens": total(agent, "recomputed_tokens"),
        "agent_recomputed_by_tool": by_tool,
        "agent_swapped_in_tokens": total(agent, "swapped_in_tokens"),
        "agent_context_tokens": sum(r.context_tokens for r in agent),
        "chat_recomputed_tokens": total(chat, "recomputed_tokens"), "chat_turns": len(chat),
        "chat_latency_s_p50": pct(chat_lat, 50), "chat_latency_s_p90": pct(chat_lat, 90),
        "errors": sum(1 for r in records if r.error),
    }  # fmt: skip


def _chunks(conv: wl.Conversation, chunk: int = 32) -> int:
    return -(-conv.context_lens()[-1] // chunk)


# ---- the sweep and the goal -------------------------------------------------------------------


def workload(shape: Shape, seed: int, agents: int | None = None, chats: int | None = None):
    """The shape's agents over its background of ShareGPT chats (the committed sample)."""
    n_chats = shape.chats if chats is None else chats
    sample = read_sample(CHATS)[0][:n_chats] if n_chats else []
    capped = (wl.cap_conversation(c, shape.spec.context_cap, 1024) for c in sample)
    convs = [wl.Conversation(f"chat-{c.id}", c.turns) for c in capped if c is not None]
    n_agents = shape.agents if agents is None else agents
    return ag.build(n_agents, shape.agent_rate, convs, shape.chat_rate, shape.think_s, seed,
                    shape.spec)  # fmt: skip


def history_chunks(work: ag.Workload) -> int:
    return sum(_chunks(p.conversation) for p in work.agents + work.chats)


def crossing(points: list[tuple[float, float]], target: float) -> float | None:
    """The memory where a decreasing slowdown crosses `target`, interpolated in log memory
    between the swept points either side (None: not crossed)."""
    points = sorted(points)
    for (m0, s0), (m1, s1) in zip(points, points[1:], strict=False):
        if s0 >= target >= s1 and s0 != s1:
            w = (s0 - target) / (s0 - s1)
            return math.exp(math.log(m0) + w * (math.log(m1) - math.log(m0)))
    return None


def slowdowns(runs: list[dict]) -> list[tuple[float, float]]:
    """(memory, ttl-pin's p90 job time over the oracle's at that memory) where both ran."""
    oracle = {r["memory"]: r for r in runs if r["mode"] == "oracle" and "failed" not in r}
    return [(r["memory"], r["jct_s_p90"] / oracle[r["memory"]]["jct_s_p90"]) for r in runs
            if r["mode"] == "ttl-pin" and "failed" not in r and r["memory"] in oracle]  # fmt: skip


def nearest(points: list[tuple[float, float]]) -> tuple[float, float]:
    """The (memory, slowdown) point nearest `GOAL_SLOWDOWN`."""
    return min(points, key=lambda p: abs(p[1] - GOAL_SLOWDOWN))


def goal_memory(runs: list[dict], run_at) -> tuple[float | None, list[dict]]:
    """The memory where ttl-pin's p90 job time is `GOAL_SLOWDOWN` x the oracle's: from the
    sweep's crossing, then ttl-pin and the oracle alone (`run_at(memory)`) at each new
    interpolation until within `GOAL_TOLERANCE`; it (None: never crossed) and those runs."""
    search: list[dict] = []
    target = None
    for _ in range(GOAL_SEARCH):
        points = slowdowns(runs + search)
        if not points:
            break
        near = nearest(points)
        if abs(near[1] - GOAL_SLOWDOWN) <= GOAL_TOLERANCE:
            return near[0], search
        target = crossing(points, GOAL_SLOWDOWN)
        if target is None:
            break
        search += run_at(target)
    points = slowdowns(runs + search)
    if target is not None and points:  # the search ran out: the nearest it saw
        target = nearest(points)[0]
    return target, search


def goal(runs: list[dict], memory: float, mode: str = "tool-aware") -> dict[str, Any]:
    """The issue's goal at one memory: `mode`'s p90 job time at most 0.85x ttl-pin's, and its
    recomputed tokens at most 0.5x LRU's; the same read for `tool-hold` beside it."""
    at = {r["mode"]: r for r in runs if r["memory"] == memory and "failed" not in r}
    if any(m not in at for m in (mode, "ttl-pin", "lru")):
        return {"memory": memory, "evaluated": False}
    ta, ttl, lru = at[mode], at["ttl-pin"], at["lru"]
    jct = ta["jct_s_p90"] / ttl["jct_s_p90"]
    recomputed = lambda r: r["agent_recomputed_tokens"] + r["chat_recomputed_tokens"]  # noqa: E731
    recompute = recomputed(ta) / max(1, recomputed(lru))
    out = {"memory": memory, "evaluated": True, "jct_p90_vs_ttl": jct,
           "recomputed_vs_lru": recompute, "met_jct": jct <= 0.85,
           "met_recompute": recompute <= 0.5, "met": jct <= 0.85 and recompute <= 0.5}  # fmt: skip
    if mode == "tool-aware" and "tool-hold" in at:
        out["tool-hold"] = goal(runs, memory, "tool-hold")
    return out


def device_of(name: str) -> str:
    """`cpu`: the real engine on this machine's CPU; any other name a simulated device."""
    return "cpu" if name == "cpu" else f"sim:{name}"


def sweep(args, shape: Shape, work: ag.Workload, log=print) -> dict[str, Any]:
    device = device_of(args.device)
    hist = history_chunks(work)
    # a turn's context must fit the GPU tier: room for the longest twice over (`fit_pools`)
    floor = 2 * max(_chunks(p.conversation) for p in work.agents + work.chats) + 2
    per = kv_bytes_per_chunk(shape.model, "bfloat16")
    ttl = args.ttl if args.ttl is not None else work.info["tool_s"]["all"]["p90"]
    modes = [MODES[m] for m in args.modes.split(",")]

    def one(mode: Mode, memory: float) -> dict[str, Any]:
        gpu = max(int(hist * memory), floor)
        cpu = int(gpu * args.cpu_ratio)
        try:
            r = run(work, mode, args.model or shape.model, device, gpu, cpu, ttl)
        except MemoryError as e:  # the engine gave up a step: recorded, the sweep goes on
            log(f"{mode.name:10s} mem {memory:.3f}: FAILED {type(e).__name__}: {e}")
            r = {"mode": mode.name, "failed": f"{type(e).__name__}: {e}", **FAILED}
        r["memory"] = memory
        r["gpu_gb"], r["cpu_gb"] = gpu * per / 2**30, cpu * per / 2**30
        if "failed" in r:
            return r
        log(f"{mode.name:10s} mem {memory:.3f} ({r['gpu_gb']:.1f}+{r['cpu_gb']:.1f} GB) "
            f"jct p50 {r['jct_s_p50']:7.1f} p90 {r['jct_s_p90']:7.1f} s  ttft p90 "
            f"{r['ttft_s_p90']:6.2f} s  recomputed {r['agent_recomputed_tokens']:>9,} agent "
            f"{r['chat_recomputed_tokens']:>9,} chat  pinned {r['pinned_gb_mean']:5.1f} GB "
            f"mean  unfinished {r['unfinished']}  [{r['real_s']:.0f}s real]")  # fmt: skip
        return r

    runs: list[dict[str, Any]] = []
    for memory in args.memory:
        runs += [one(m, memory) for m in modes]
    target, search = None, []
    pair = [m for m in modes if m.name in ("ttl-pin", "oracle")]
    if len(pair) == 2 and not args.no_refine:
        target, search = goal_memory(runs, lambda memory: [one(m, memory) for m in pair])
        if target is not None and not any(r["memory"] == target for r in runs):
            runs += [one(m, target) for m in modes if m not in pair]
            runs += [r for r in search if r["memory"] == target]
    if target is None and (points := slowdowns(runs)):  # not crossed: the nearest swept
        target = nearest(points)[0]
    keys = ("mode", "memory", "gpu_gb", "jct_s_p90")
    return {"history_chunks": hist, "bytes_per_chunk": per, "ttl_s": ttl, "runs": runs,
            "goal_search": [{k: r[k] for k in keys if k in r} for r in search],
            "goal": goal(runs, target) if target is not None else {"evaluated": False}}  # fmt: skip


def plot(result: dict[str, Any], path: Path) -> None:
    from bench.lib.plots import plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = (("jct_s_p90", "job completion time p90 (s)"),
              ("ttft_s_p90", "time to first token per step, p90 (s)"),
              ("recomputed", "recomputed tokens (agents + chats)"),
              ("pinned_gb_mean", "pinned KV, mean (GB)"))  # fmt: skip
    for ax, (key, label) in zip(axes.flat, panels, strict=True):
        for mode in MODES:
            rs = sorted((r for r in result["runs"] if r["mode"] == mode and "failed" not in r),
                        key=lambda r: r["memory"])  # fmt: skip
            ys = [r["agent_recomputed_tokens"] + r["chat_recomputed_tokens"]
                  if key == "recomputed" else r[key] for r in rs]  # fmt: skip
            style = {"color": "black", "ls": "--"} if mode == "oracle" else {}
            if rs:
                ax.plot([r["gpu_gb"] for r in rs], ys, marker="o", label=mode, **style)
        ax.set(xlabel="GPU tier (GB); the CPU tier as large, the oracle's all", ylabel=label)
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    env, g = result["environment"], result["goal"]
    verdict = (
        (
            f"; at {g['memory']:.3f}: tool-aware p90 JCT {g['jct_p90_vs_ttl']:.3f}x "
            f"ttl-pin, recompute {g['recomputed_vs_lru']:.3f}x lru"
        )
        if g.get("evaluated")
        else ""
    )
    how = "SIMULATED" if result["simulated"] else "REAL"
    fig.suptitle(f"{how} {result['device']} {result['model']}: {result['agents']} agents "
                 f"over {result['chats']} chats ({env['git_commit'][:9]}){verdict}",
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = p.add_argument
    add("--shape", choices=sorted(SHAPES), default="8b")
    add("--device", default="h100", help="a simulated device, or cpu: real")
    add("--model", default=None, help="the shape's model unless given")
    add("--modes", default=",".join(MODES))
    add(
        "--memory",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[0.05, 0.1, 0.2],
        help="GPU tier as a share of every context",
    )
    add("--cpu-ratio", type=float, default=1.0, help="CPU tier = this x GPU tier")
    add(
        "--ttl", type=float, default=None, help="ttl-pin's TTL (s); default the tools' p90 duration"
    )
    for name in ("--agents", "--chats"):
        add(name, type=int, default=None)
    add("--seed", type=int, default=0)
    add("--no-refine", action="store_true", help="no run at the interpolated memory")
    add("--out", type=Path, default=None)  # fmt: skip
    args = p.parse_args(argv)
    shape = SHAPES[args.shape]
    work = workload(shape, args.seed, args.agents, args.chats)
    print(json.dumps(work.info["tool_s"]["all"]), wl.format_summary(work.info["agent_summary"]))
    device = device_of(args.device)
    result: dict[str, Any] = {
        "benchmark": "retention", "simulated": device != "cpu", "device": device,
        "shape": args.shape, "model": args.model or shape.model, "agents": len(work.sessions),
        "chats": len(work.chats), "tools": [asdict(t) for t in shape.spec.tools],
        "workload": work.info, "cpu_ratio": args.cpu_ratio, "environment": environment(),
    }  # fmt: skip
    result.update(sweep(args, shape, work))
    g = result["goal"]
    print("goal:", json.dumps(g))
    kind = "real" if device == "cpu" else "sim"
    out = args.out or RESULTS / f"agents-{kind}-{args.device}-{args.shape}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
