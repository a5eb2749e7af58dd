"""A step's host time with the device's work taken out: a real `Engine` over `NoForward`, a
pool of a few bytes a block, linear Cost(l); `--conversations` seeded in both tiers, a turn
arriving each step until `--decodes` run. Timed: `Engine.step` (wall and thread CPU time)
split by phase, `submit`, the snapshot.

    python -m bench.host_step                  # bench/results/host-step-cpu.json, .png
    python -m bench.host_step --profile 25     # and its 25 costliest functions

`measure(Load(...), device)` is the benchmark as a function (a GPU profile reuses it). Its
two smaller parts, `prep` (the runner's tensors of a step, was `bench.step_prep`) and `cache`
(the cache's bookkeeping over many idle chats, was `bench.cache_step`), are retired:
`git show eb6928e:bench/host_step.py`, bench/README.md.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from bench.lib.common import RESULTS, device_slug, environment
from engine import Engine, EngineConfig, SamplingParams, Turn
from engine.backends.local import Local
from engine.cache.policy import CostModel
from engine.kv_layout import KVLayout
from engine.kv_pool import KVPool
from engine.runner import Runner
from engine.seed import Seed

GOAL_MS = 2.0  # the goal: host time per step at the default load
PHASES = ("schedule", "build", "copies", "forward", "sample", "bookkeeping")


@dataclass
class Load:
    conversations: int = 1600
    context: int = 600  # mean tokens of a seeded conversation (uniform within +-1/3)
    decodes: int = 75  # decodes per step once ramped up
    prompt: int = 73  # new tokens of each arriving turn
    steps: int = 300  # steps measured
    warmup: int = 150  # steps before (the ramp of decodes + 1 steps included)
    gpu_cache_chunks: int = 4096
    cpu_cache_chunks: int = 40960
    model: str = "dummy:tiny"
    seed: int = 0


class NoForward:
    """The forward replaced by nothing: the pool's per-layer hook, then zero logits of
    `vocab` columns (the argmax over a real vocabulary is the device's work too)."""

    def __init__(self, vocab: int = 16) -> None:
        self.vocab = vocab
        self.logits: torch.Tensor | None = None

    def set_kv_groups(self, groups: tuple[int, ...]) -> None:
        """Each layer's page group: nothing reads it here."""

    def __call__(self, ids, positions, layers, meta, slots, rows, before_attention=None, **kw):
        if before_attention is not None:
            for layer in range(len(layers)):
                before_attention(layer)
        n = rows.shape[0]
        if self.logits is None or self.logits.shape[0] < n or self.logits.device != rows.device:
            self.logits = torch.zeros((max(n, 256), self.vocab), device=rows.device)
        return self.logits[:n]


class HostOnly(Local):
    """`Local` with `NoForward`, a pool of one KV head of 4 values, and linear Cost(l)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.pool_args = replace(self.args, n_kv_heads=1, head_dim=4)

    def pool(self, gpu_blocks: int, cpu_blocks: int, layout: KVLayout) -> KVPool:
        c = self.config
        return KVPool(self.pool_args, gpu_blocks, cpu_blocks, c.chunk_size, self.device,
                      self.dtype, layout=layout)  # fmt: skip

    def runner(self, pool: KVPool) -> Runner:
        return Runner(NoForward(), pool, self.config.chunk_size, self.attention)

    def policy_cost(self, max_context: int) -> CostModel:
        return CostModel.linear(self.config.chunk_size, max_context)


def build_engine(load: Load, device: str = "cpu") -> Engine:
    config = EngineConfig(
        model=load.model, device=device, gpu_cache_chunks=load.gpu_cache_chunks,
        cpu_cache_chunks=load.cpu_cache_chunks, max_running=max(256, load.decodes + 1),
        pack_cpu_weights=False, cuda_graphs=False,  # the weights are never used
    )  # fmt: skip
    return Engine(config, backend=HostOnly(config))


def seeds(load: Load, engine: Engine, rng: random.Random) -> list[Seed]:
    """Conversations of about `load.context` tokens, idle up to an hour, each with its last
    one or two chunks on the GPU (every other one with a CPU copy) and the rest on the CPU."""
    cs, now = engine.cache.chunk_size, engine.now()
    out = []
    for i in range(load.conversations):
        n = max(2, round(load.context * rng.uniform(2 / 3, 4 / 3)))
        kv = n - 1  # a turn's end leaves its last sampled token uncomputed
        chunks = -(-kv // cs)
        gpu = min(chunks, 1 + i % 2)
        tiers = ["cpu"] * (chunks - gpu) + ["both"] * (gpu - 1) + ["gpu"]
        tokens = [rng.randrange(1, 1000) for _ in range(n)]
        last = now - rng.uniform(1.0, 3600.0)
        out.append(Seed(f"c{i}", tokens, tiers, last, computed=kv))
    return out


class Phases:
    """Seconds spent in wrapped methods of one engine, by phase (for this run only)."""

    def __init__(self) -> None:
        self.s: dict[str, float] = {}
        self.pieces: list[tuple[int, int]] = []  # (decodes, other tokens) of each forward

    def wrap(self, obj: Any, name: str, phase: str) -> None:
        fn, clock = getattr(obj, name), time.perf_counter

        def timed(*args, **kwargs):
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.s[phase] = self.s.get(phase, 0.0) + clock() - start

        setattr(obj, name, timed)

    def attach(self, engine: Engine) -> None:
        r, pool = engine.runner, engine.pool
        for obj, name, phase in ((engine.scheduler, "schedule", "schedule"), (r, "step", "runner"),
                                 (r, "run", "forward"), (r, "sampler", "sample"),
                                 (pool, "begin_step", "copies_before"),
                                 (pool, "end_step", "copies_after")):  # fmt: skip
            self.wrap(obj, name, phase)
        step = r.step

        def counted(pieces, plan):
            decodes = sum(1 for p in pieces if p.end - p.start == 1)
            self.pieces.append((decodes, sum(p.end - p.start for p in pieces) - decodes))
            return step(pieces, plan)

        r.step = counted

    def split(self, before: dict[str, float], total_s: float) -> dict[str, float]:
        """One step's phases in ms, from the totals before it and its wall time (copies
        before the forward start inside the runner's step, those after outside it)."""
        d = {k: v - before.get(k, 0.0) for k, v in self.s.items()}
        g = lambda k: d.get(k, 0.0)  # noqa: E731
        ms = {
            "schedule": g("schedule"),
            "build": g("runner") - g("forward") - g("sample") - g("copies_before"),
            "copies": g("copies_before") + g("copies_after"),
            "forward": g("forward"),
            "sample": g("sample"),
            "bookkeeping": total_s - g("schedule") - g("runner") - g("copies_after"),
        }
        return {k: v * 1e3 for k, v in ms.items()}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _ms(xs: list[float], *keys: str) -> dict[str, float]:
    f = {"median": statistics.median, "p90": lambda v: _pct(v, 0.9), "mean": statistics.fmean}
    return {k: round(f[k](xs), 3) for k in keys}


def measure(
    load: Load, device: str = "cpu", profile: Callable[[cProfile.Profile], None] | None = None
) -> dict[str, Any]:
    """Run `load` on a fresh engine; the figures as a dict (`profile`: given the measured
    steps' cProfile, which slows them)."""
    rng = random.Random(load.seed)
    engine = build_engine(load, device)
    try:
        start = time.perf_counter()
        engine.seed(seeds(load, engine, rng))
        seed_s = time.perf_counter() - start
        idle = deque(f"c{i}" for i in rng.sample(range(load.conversations), load.conversations))
        in_flight: dict[str, Any] = {}
        sampling = SamplingParams(max_tokens=load.decodes + 1, ignore_eos=True)
        phases = Phases()
        phases.attach(engine)
        steps_ms, cpu_ms, submit_ms, split = [], [], [], []
        prof = cProfile.Profile() if profile is not None else None
        for n in range(load.warmup + load.steps):
            measured = n >= load.warmup
            if len(in_flight) < load.decodes + 1 and idle:  # one arrival a step
                cid = idle.popleft()
                prompt = [rng.randrange(1, 1000) for _ in range(load.prompt)]
                t0 = time.perf_counter()
                in_flight[cid] = engine.submit(Turn(cid, prompt, sampling))
                if measured:
                    submit_ms.append((time.perf_counter() - t0) * 1e3)
            totals = dict(phases.s)
            if prof is not None and measured:
                prof.enable()
            t0, c0 = time.perf_counter(), time.thread_time()
            ended = engine.step()
            dt, dc = time.perf_counter() - t0, time.thread_time() - c0
            if prof is not None and measured:
                prof.disable()
            for req in ended:
                del in_flight[req.state.id]
                idle.append(req.state.id)
            if measured:
                steps_ms.append(dt * 1e3)
                cpu_ms.append(dc * 1e3)
                split.append(phases.split(totals, dt))
        pieces = phases.pieces[-load.steps :]
        snapshot_ms, capture_ms = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            capture = engine.capture()  # the half under the engine's lock
            t1 = time.perf_counter()
            capture.build()
            capture_ms.append((t1 - t0) * 1e3)
            snapshot_ms.append((time.perf_counter() - t0) * 1e3)
        if prof is not None:
            profile(prof)
        return {
            "load": asdict(load),
            "device": device,
            "goal_ms": GOAL_MS,
            "host_ms": _ms(steps_ms, "median", "p90", "mean"),
            # the step thread's CPU time: the wait for a core on a shared machine left out
            "host_cpu_ms": _ms(cpu_ms, "median", "p90"),
            "phases_ms": {k: _ms([s[k] for s in split], "median", "mean") for k in PHASES},
            "per_step": {
                "decodes": statistics.median(p[0] for p in pieces),
                "prompt_tokens": statistics.median(p[1] for p in pieces),
            },
            "submit_ms": round(statistics.median(submit_ms), 3) if submit_ms else None,
            "snapshot_ms": round(statistics.median(snapshot_ms), 3),
            "snapshot_capture_ms": round(statistics.median(capture_ms), 3),
            "seed_s": round(seed_s, 3),
            "held": len(engine.cache.tables),
            "counters": asdict(engine.counters),
            "steps_ms": [round(x, 4) for x in steps_ms],
            "environment": environment(engine.device),
        }
    finally:
        engine.close()


def plot(result: dict[str, Any], path: Path) -> Path:
    from bench.lib.plots import plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    h, goal = result["host_ms"], result["goal_ms"]
    ax.plot(result["steps_ms"], lw=0.8, color="tab:blue", label="host ms per step")
    for y, style, label in ((h["median"], ("tab:blue", "--"), f"median {h['median']:.2f}"),
                            (h["p90"], ("tab:orange", ":"), f"p90 {h['p90']:.2f}"),
                            (goal, ("tab:red", "-"), f"goal {goal:g}")):  # fmt: skip
        ax.axhline(y, color=style[0], ls=style[1], lw=1, label=label)
    ax.set(xlabel="measured step", ylabel="ms", ylim=(0, None))
    ax.legend(fontsize=8)
    bars = bx.barh(
        list(PHASES), [result["phases_ms"][k]["mean"] for k in PHASES], color="tab:green"
    )
    bx.bar_label(bars, fmt="%.3f", fontsize=7)
    bx.invert_yaxis()
    bx.set_xlabel("mean ms per step")
    for a in (ax, bx):
        a.grid(True, alpha=0.3)
    lo, per, env = result["load"], result["per_step"], result["environment"]
    fig.suptitle(
        f"Host time of a step, forward replaced by nothing: {lo['conversations']} held, "
        f"{per['decodes']:g} decodes + {per['prompt_tokens']:g} prompt tokens "
        f"({env['device']}, {env['git_commit'][:12]})", fontsize=9,
    )  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- main -------------------------------------------------------------------------------------


def print_profile(top: int) -> Callable[[cProfile.Profile], None]:
    def show(prof: cProfile.Profile) -> None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
        print(out.getvalue(), file=sys.stderr)

    return show


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    d = Load()
    for name, value in asdict(d).items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    add = ap.add_argument
    add("--device", default="cpu")
    add("--profile", type=int, default=0, help="print the N costliest functions")
    add("--out", type=Path, default=None, help="the JSON (and .png beside it)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    load = Load(**{k: getattr(args, k) for k in asdict(d)})
    result = measure(load, args.device, print_profile(args.profile) if args.profile else None)
    keys = ("host_ms", "host_cpu_ms", "phases_ms", "per_step", "snapshot_ms",
            "snapshot_capture_ms")  # fmt: skip
    print(json.dumps({k: result[k] for k in keys}, indent=2))
    out = args.out or RESULTS / f"host-step-{device_slug(result['environment']['device'])}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
