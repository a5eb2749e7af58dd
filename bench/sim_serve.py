"""The GPU report's serving parts in virtual time (`python -m bench.sim`): a part rehearsed
(`--gpu-serve`, `--gpu-steady`: the part itself, `bench/parts/serving.py`, on engines of a
device's cost model) and the twin of a real report's serve runs (`--gpu-report`); with the
steady part's states and twin (`bench/sim_steady.py`) the command's GPU flags (`gpu_main`).
Every figure here is SIMULATED."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
from dataclasses import asdict, replace

from bench.lib import versus
from bench.lib import workload as wl
from bench.lib.common import RESULTS, ROOT, environment
from bench.lib.gpu_settings import (
    ENGINE_START_S,
    PIN_S_PER_GIB,
    RUN_OVERHEAD_S,
    STEADY_MODES,
    Settings,
    label,
    lent_room,
    load_sample,
    preset_for,
    report_settings,
    simulated_engine,
    window_of,
)
from bench.lib.metrics import run_line
from bench.lib.pools import kv_bytes_per_chunk, model_args
from bench.lib.presets import MODES, floats
from bench.lib.replay import Virtual, serve_run
from bench.parts.serving import part_serve, part_steady
from bench.sim_steady import choose
from bench.sim_steady import twin as steady_twin
from engine import Engine
from engine.sim.cost import Shape, Work
from engine.sim.devices import gpu_device

SIM = RESULTS / "sim"


def _log(*a) -> None:
    print(*a, flush=True)


# The queue limit of a report whose runs do not record theirs: the server's default then
# (`EngineConfig.max_waiting`), which the H100 and H200 reports ran with.
REPORT_QUEUE = 256


# A real driver's sends land within a few ms of their plan; near saturation that alone moves
# a run's mean latency by tens of percent (which turns queue, which are cut at the drain), so
# a twin's spread reruns it with every send moved by up to this much (`jittered`).
JITTER_S = 0.002


def jittered(plans: list[wl.Plan], seed: int) -> list[wl.Plan]:
    """The same plans with each arrival and think time moved by up to `JITTER_S` (seeded)."""
    rng = random.Random(seed)

    def move(t: float) -> float:
        return max(0.0, t + rng.uniform(-JITTER_S, JITTER_S))

    return [replace(p, arrival_s=move(p.arrival_s), think_s=[move(t) for t in p.think_s])
            for p in plans]  # fmt: skip


async def twin_run(s, convs, mode: str, engine_mode: str, rate: float, k: float, device: str,
                   oracle: int | None = None, queue: int | None = None,
                   jitter: int | None = None) -> dict:  # fmt: skip
    """One serving run of a GPU report in virtual time, as the real one ran: refused at a
    full queue of `queue` turns (None: `BENCH_QUEUE`), cut at the drain's end; `jitter`:
    the seed of sends moved by a few ms (`jittered`)."""
    window, drain = window_of(s, k)
    engine = simulated_engine(preset_for(s, k, oracle), engine_mode, device, queue)
    try:
        plans = wl.plan(convs, rate, s.think_s / k, 0)
        if jitter is not None:
            plans = jittered(plans, jitter)
        return await serve_run(Virtual(engine), plans, mode, mode, engine_mode, rate, k,
                               s.think_s, (window, drain))  # fmt: skip
    finally:
        engine.close()


def twin(report: dict, device: str = "h100", log=_log, spread: int = 0) -> dict:
    """The serve runs of a GPU report again on a simulated device, each cut as its real one
    was (`twin_run`), and the error of each run and each capacity (`versus.capacities`:
    where it crossed the bound, else a lower bound). `spread`: each run that many times more with its
    sends moved by a few ms (`jittered`): the range and median of its mean latency."""
    s = report_settings(report["settings"])
    convs, _ = load_sample(s)
    host = host_model(s, device)
    runs, points = [], []
    for real in report["serve"]["runs"]:
        oracle = real["cpu_cache_chunks"] if real["mode"] == "oracle" else None
        queue = real.get("max_waiting", REPORT_QUEUE)

        def again(jitter: int | None = None, real=real, oracle=oracle, queue=queue) -> dict:
            return asyncio.run(twin_run(s, convs, real["mode"], real["engine_mode"], real["rate"],
                                        real["scale"], device, oracle, queue, jitter))  # fmt: skip

        run = again()
        runs.append(run)
        point = {"mode": real["mode"], "rate": real["rate"], "scale": real["scale"],
                 **versus.points(real, run)}  # fmt: skip
        if ms := step_ms(real, run, host):
            point["step_ms"] = ms
        if spread:
            draws = [run] + [again(seed) for seed in range(1, spread + 1)]
            point["norm_latency_mean"].update(
                latency_spread(draws, real["metrics"]["norm_latency_mean"])
            )
        points.append(point)
        ms = point.get("step_ms")
        steps = f", {ms['real']:.1f} ms/step, simulated {ms['sim']:.1f}" if ms else ""
        log(
            run_line(run)
            + f"  (real {real['metrics']['norm_latency_mean'] * 1e3:.1f} ms/tok{steps})"
        )
    caps = versus.capacities(report["serve"]["runs"], runs, s.bound)
    timed = [p for p in points if "step_ms" in p]
    fit = host_fit(timed) if len(timed) > 1 else None
    return {"simulated": label(device), "runs": runs, "points": points, "capacity": caps,
            "step_host": {"model_ms": [host[0] * 1e3, host[1] * 1e3],
                          "fit_ms": fit and [fit[0] * 1e3, fit[1] * 1e3]}}  # fmt: skip


def latency_spread(runs: list[dict], real: float) -> dict:
    """The mean normalized latency over a run's twins: range, median, the median's error."""
    got = sorted(r["metrics"]["norm_latency_mean"] for r in runs)
    median = statistics.median(got)
    return {"spread": [got[0], median, got[-1]], "runs": len(got),
            "median_error": (median - real) / real if real else None}  # fmt: skip


def host_model(s, device: str) -> tuple[float, float]:
    """The device model's host time (`StepCost.host_s`) for the report's model: seconds per
    step, and per sampled row."""

    cost = gpu_device(device, Shape.of(model_args(s.model), s.dtype)).cost
    step = cost.host_s([Work(1, 0, False)])
    return step, cost.host_s([Work(1, 0, True)]) - step


def step_ms(real: dict, sim: dict, host: tuple[float, float]) -> dict | None:
    """Milliseconds per step, real (its wall time over its steps) and simulated; sampled rows
    per step (generated tokens over steps) of each; and the host time per step that the
    real run implies: its time per step less the model's own (the simulated step less the
    model's host time at the simulated rows). `host_fit` fits the device's host figures to
    these."""
    rc, sc = real.get("counters", {}), sim["counters"]
    if not rc.get("steps") or not sc["steps"]:
        return None
    r, v = real["wall_s"] / rc["steps"], sim["wall_s"] / sc["steps"]
    rows = {
        "real": rc["generated_tokens"] / rc["steps"],
        "sim": sc["generated_tokens"] / sc["steps"],
    }
    model = host[0] + host[1] * rows["sim"]
    return {"real": r * 1e3, "sim": v * 1e3, "error": (v - r) / r, "rows": rows,
            "host_model": model * 1e3, "host_implied": (r - (v - model)) * 1e3}  # fmt: skip


def host_fit(points: list[dict]) -> tuple[float, float]:
    """Host seconds per step and per sampled row that fit the host times the twins' runs
    imply (`step_ms`) against their real rows per step: least squares, neither negative
    (a negative intercept: a line through the origin; a negative slope: a constant)."""
    if not points:
        raise ValueError("no run to fit")
    xs = [p["step_ms"]["rows"]["real"] for p in points]
    ys = [p["step_ms"]["host_implied"] * 1e-3 for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / spread if spread else 0.0
    a = my - b * mx
    if a < 0:
        a, b = 0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    if b < 0:
        a, b = max(0.0, my), 0.0
    return a, b


class Rehearsed:
    """A part's engines on a simulated device, in virtual time: an Engine of its own per run
    (the same run whatever ran before it), the part's time estimated: each engine's start
    (`ENGINE_START_S`, measured with the serve part's second tier pinned; `pin`: the steady
    part's larger one at `PIN_S_PER_GIB` more), each run's span (cut at its window and
    drain) and its seeding, and `RUN_OVERHEAD_S` after it."""

    def __init__(self, s, device: str, budget_s: float, pin: bool = False) -> None:
        self.s, self.device, self.budget_s, self.pin = s, device, budget_s, pin
        self.t = 0.0
        self.key: tuple | None = None
        self.engine: Engine | None = None
        self.starts: dict[str, float] = {}

    def left(self) -> float:
        return self.budget_s - self.t

    def room(self, gpu_chunks: int, cpu_chunks: int) -> str | None:
        return lent_room(self.s, self.device, gpu_chunks, cpu_chunks)

    async def target(self, mode: str, preset) -> Virtual:
        key = (mode, preset.gpu_cache_chunks, preset.cpu_cache_chunks)
        if key != self.key:  # the real part starts an engine here
            self.key = key
            cpu = preset.cpu_cache_chunks if MODES[mode].cache_mode == "pensieve" else 0
            pinned = cpu * kv_bytes_per_chunk(self.s.model, self.s.dtype) / 2**30
            self.starts[mode] = ENGINE_START_S + (PIN_S_PER_GIB * pinned if self.pin else 0.0)
            self.t += self.starts[mode]
        await self.close()
        self.engine = simulated_engine(preset, mode, self.device)
        return Virtual(self.engine)

    def ran(self, run: dict, longest_s: float) -> None:
        run["estimated_wall_s"] = run.get("seed_s", 0.0) + min(run["wall_s"], longest_s)
        self.t += run["estimated_wall_s"] + RUN_OVERHEAD_S
        run["ends_at_s"] = self.t

    async def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def rehearse(part: str, s, device: str = "h100") -> dict:
    """A GPU report's serving part (`serve` or `steady`) rehearsed: the part itself on
    `Rehearsed` engines, with its budget rule. Its runs and skips, each mode's capacity, its
    estimated wall time against its budget, and whether every mode crossed the bound between
    two of its rates."""
    budget = s.steady_budget_s if part == "steady" else s.budget_s
    engines = Rehearsed(s, device, budget, pin=part == "steady")
    run_part = part_steady if part == "steady" else part_serve
    out = asyncio.run(run_part(s, budget, None, engines))
    caps = out["capacity"]
    out.update(simulated=label(device), settings=asdict(s), estimated_s=engines.t,
               fits=engines.t <= budget,
               all_crossed=bool(caps) and all(c["capacity_rps"] is not None for c in caps.values()))  # fmt: skip
    return out


def gpu_main(args) -> int:
    """`--gpu-serve`, `--gpu-report R` (with `--gpu-steady`: its steady runs),
    `--gpu-steady` and `--steady-states` of `python -m bench.sim`."""
    s = replace(Settings(), bound=args.bound) if args.bound else Settings()
    steady = args.gpu_steady or args.steady_states
    if args.gpu_report:
        report = json.loads(args.gpu_report.read_text())
        part = "steady" if steady else "serve"
        if not report.get(part, {}).get("runs"):
            print(f"{args.gpu_report} has no {part} runs to simulate")
            return 0
        if steady:
            result = steady_twin(report, args.device)
            print(json.dumps(result["capacity"], indent=1))
        else:
            result = twin(report, args.device, spread=args.spread)
            print(json.dumps({k: result[k] for k in ("capacity", "step_host")}, indent=1))
        name = f"{args.gpu_report.stem}-{'steady-' if steady else ''}sim-{args.device}.json"
        out = args.out or args.gpu_report.with_name(name)
    elif args.steady_states:
        modes = args.modes.split(",") if args.modes else list(STEADY_MODES)
        start = floats(args.rates)[0] if args.rates else None  # where each walk starts
        result = choose(s, args.device, modes, ROOT / s.steady_states, start)
        out = args.out or SIM / f"steady-states_{args.device}_{'-'.join(modes)}.json"
        print(f"rates chosen: {result['rates']}; skipped {result['skipped'] or 'nothing'}")
    elif args.gpu_steady:
        result = rehearse("steady", s, args.device)
        out = args.out or SIM / f"gpu-steady_{args.device}.json"
        print(f"about {result['estimated_s']:.0f} s of the {s.steady_budget_s:.0f} s budget "
              f"(fits: {result['fits']}); skipped {result['skipped'] or 'nothing'}; every mode "
              f"crossed: {result['all_crossed']}")  # fmt: skip
        for mode, c in result["capacity"].items():
            print(f"  {mode}: {c}")
    else:
        if args.rates:
            s = replace(s, rates=floats(args.rates))
        if args.conversations:
            s = replace(s, conversations=args.conversations)
        result = rehearse("serve", s, args.device)
        out = args.out or SIM / f"gpu-serve_{args.device}.json"
        print(f"about {result['estimated_s']:.0f} s of the {s.budget_s:.0f} s budget; "
              f"skipped {result['skipped'] or 'nothing'}; every mode crossed: {result['all_crossed']}")  # fmt: skip
    result["environment"] = {**environment(), "device": label(args.device), "simulated": True}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=float) + "\n")
    print(f"wrote {out}")
    return 0
