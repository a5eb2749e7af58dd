"""The simulated `cpu` device, calibrated on the machine it runs on: real steps of the real
engine over a grid of prompt lengths, decode batches and contexts (equal, and mixed in one
batch), fitted by least squares
on the features of `engine/sim/cost.py`; the tiers' copy rate from real pool copies; the
eviction policy's Cost(l) the real engine's own profile on this machine (the same file).

Cached per model, dtype and torch thread count (a step on one thread costs about twice a
step on two), like the eviction policy's cost profile. It lives above `engine/sim/` (which
builds no real engine) and is handed the engine class that it times (`build`), so that the
engine, which picks a simulated backend, and this module never import each other.
"""

from __future__ import annotations

import json
import logging
import platform
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.cache.policy import CostModel
from engine.copies import CopyPlan
from engine.kv_pool import KVPool
from engine.model.loader import cache_root
from engine.sim.cost import Features, Fitted, Work
from engine.sim.devices import NVME, Copies, Device
from engine.types import EngineConfig, SamplingParams, Turn

log = logging.getLogger(__name__)

PROMPTS = (32, 64, 128, 256, 384, 512)  # one prompt alone per step
BATCHES = (1, 4, 16, 32)  # decode batches ...
CONTEXTS = (128, 768)  # ... at these contexts
DECODE_TOKENS = 4
# A prompt of n tokens joining b decodes at CONTEXTS[-1] (after their chunked prefills)
MIXED = tuple((n, b) for n in (64, 256, 448) for b in BATCHES[1:])
FIT = 4  # the fit's own version (the device's, VERSIONS["cpu"], also counts its disk)


Build = Callable[[EngineConfig], Any]  # an engine class: the real engine this times


def cpu_device(config: EngineConfig, build: Build) -> Device:
    """The fitted CPU model of `config.model`, calibrated now if this machine has none."""
    return device_from(fitted(config, build))


def fitted(config: EngineConfig, build: Build) -> dict:
    """This machine's calibration of `config.model` (made now with engines of `build` if
    there is none)."""
    path = _path(config)
    if not path.exists():
        t = time.perf_counter()
        fit = calibrate(config, build)
        log.info("calibrated the cpu cost model in %.0fs", time.perf_counter() - t)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(fit, indent=1))
        tmp.replace(path)
    return json.loads(path.read_text())


def speed_probe(repeats: int = 5) -> float:
    """Median seconds of a fixed piece of work shaped like an engine step on a CPU (a
    decode's weight reads and a prompt's matmuls, 75 MB of weights: past the caches): the
    machine's speed now. A shared machine's speed drifts; a calibration and the real runs
    compared with it are only comparable where their probes agree."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(1536, 1536, generator=g) for _ in range(8)]
    decode, prompt = torch.randn(16, 1536, generator=g), torch.randn(128, 1536, generator=g)

    def work() -> None:
        for w in weights:
            decode @ w
            prompt @ w

    work()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        work()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def device_from(fit: dict) -> Device:
    copies = Copies(fit["swap_in_bps"], fit["swap_out_bps"], 0.0, synchronous=True)
    cost = Fitted("cpu", tuple(fit["weights"]))
    policy = CostModel.from_dict(fit["policy_cost"])
    return Device("cpu", cost, copies, float("inf"), (fit["file"], NVME.source), NVME, policy)


def _path(config: EngineConfig) -> Path:
    from engine.backends.local import use_gguf  # not at import: backends import this module

    dtype = config.dtype or "float32"
    # A step with the GGUF's 4-bit linears costs what it costs: a fit of its own
    weights = "-int4" if use_gguf(config, torch.device("cpu"), getattr(torch, dtype)) else ""
    name = f"cpu-{config.model}-{dtype}{weights}-{torch.get_num_threads()}t-v{FIT}.json"
    return cache_root(config.cache_dir) / "sim" / name.replace(":", "_").replace("/", "_")


def calibrate(config: EngineConfig, build: Build) -> dict:
    """Steps of the real engine, each timed whole (scheduling, forward, sampling)."""
    real = build(
        EngineConfig(
            model=config.model,
            device="cpu",
            dtype=config.dtype or "float32",
            weights=config.weights,
            max_batch_tokens=config.max_batch_tokens,
            gpu_cache_chunks=4096,
            cpu_cache_chunks=0,
            cache_mode="gpu",
            eviction="lru",  # timed as before (its Cost(l) is read below, not timed)
            cache_dir=config.cache_dir,
        )
    )
    rows: list[list[float]] = []
    times: list[float] = []
    seen: list[Features] = []
    step = real.runner.step

    def recorded(pieces, plan):
        seen.append(Features.of([Work(p.end - p.start, p.start, p.sample) for p in pieces]))
        return step(pieces, plan)

    real.runner.step = recorded
    probes = [speed_probe()]
    rng = random.Random(0)
    vocab = real.args.vocab_size

    def run(turns: list[Turn], joining: Turn | None = None, after: int | None = None) -> None:
        """Serve `turns` to their ends; `joining` is submitted at step `after`, and the steps
        after that one are not recorded (the decode grid has them)."""
        for t in turns:
            real.submit(t)
        steps = 0
        while real.has_work() or joining is not None:
            if joining is not None and steps == after:
                real.submit(joining)
                joining = None
            seen.clear()
            t0 = time.perf_counter()
            real.step()
            dt = time.perf_counter() - t0
            if seen and (after is None or steps <= after):
                rows.append(seen[0].row())
                times.append(dt)
            steps += 1

    def turn(cid: str, n: int, out: int) -> Turn:
        ids = [rng.randrange(1, vocab) for _ in range(n)]
        return Turn(cid, ids, SamplingParams(max_tokens=out, ignore_eos=True))

    run([turn("warm-up", 64, 4)])
    rows.clear()
    times.clear()
    for n in PROMPTS:
        for k in range(2):
            run([turn(f"p{n}-{k}", n, 1)])
    for ctx in CONTEXTS:
        for b in BATCHES:
            run([turn(f"d{ctx}-{b}-{i}", ctx, DECODE_TOKENS) for i in range(b)])
    lo, hi = min(CONTEXTS), max(CONTEXTS)
    for b in BATCHES[1:]:  # mixed contexts: the decodes' padding to the longest shows
        run([turn(f"m{b}-{i}", lo + (hi - lo) * i // (b - 1), DECODE_TOKENS) for i in range(b)])
    # Most serving steps carry a prompt with the decodes (one batch): time them too, with
    # the prompt joining once every decode has its context.
    for n, b in MIXED:
        prefill = -(-b * hi // config.max_batch_tokens) + 1
        decodes = [turn(f"j{n}-{b}-{i}", hi, prefill + 4) for i in range(b)]
        run(decodes, turn(f"j{n}-{b}", n, 1), after=prefill)
    weights = _nonnegative_fit(rows, times)
    pred = [sum(w * x for w, x in zip(weights, r, strict=True)) for r in rows]
    errors = sorted(abs(p - t) / t for p, t in zip(pred, times, strict=True))
    probes.append(speed_probe())
    swap_in, swap_out = _copy_rates(real)
    policy = real.backend.policy_cost(real.max_context).to_dict()  # a real engine's
    real.close()
    return {
        "file": _path(config).name,
        "model": config.model,
        "threads": torch.get_num_threads(),
        "max_batch_tokens": config.max_batch_tokens,  # the grid's steps are cut to it
        "machine": platform.processor() or platform.machine(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "features": list(Features.NAMES),
        "weights": weights,
        "steps": len(rows),
        "median_abs_error": errors[len(errors) // 2],
        "p90_abs_error": errors[int(len(errors) * 0.9)],
        "swap_in_bps": swap_in,
        "swap_out_bps": swap_out,
        "policy_cost": policy,
        "probe_s": probes,  # the machine's speed before and after the timed steps
    }


def _nonnegative_fit(rows: list[list[float]], times: list[float]) -> list[float]:
    """Least squares with every weight >= 0 (each feature only adds work): the most
    negative weight is dropped and the rest refitted, until none is. Fitted on relative error, so that
    short decode steps count as much as long prompts."""
    x = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(times, dtype=torch.float64)
    scale = 1.0 / y
    active = list(range(x.shape[1]))
    while True:  # SVD-based (rank-deficient grids are common); drop the most negative
        sol = torch.linalg.lstsq(x[:, active] * scale[:, None], y * scale, driver="gelsd").solution
        if (sol >= 0).all():
            break
        del active[int(sol.argmin())]
    weights = [0.0] * x.shape[1]
    for a, w in zip(active, sol.tolist(), strict=True):
        weights[a] = w
    return weights


def _copy_rates(real) -> tuple[float, float]:
    """Bytes per second of the pool's swap-in and swap-out on this machine (median of 5)."""
    n = 256
    pool = KVPool(real.args, n, n, real.config.chunk_size, real.device, real.dtype)
    pairs = list(zip(random.Random(1).sample(range(n), n), range(n), strict=True))
    per = KVPool.bytes_per_block(real.args, real.config.chunk_size, real.dtype)

    def rate(plan: CopyPlan) -> float:
        runs = []
        for _ in range(5):
            t = time.perf_counter()
            pool.begin_step(plan)
            pool.swap_in_now()
            pool.end_step(CopyPlan())
            runs.append(time.perf_counter() - t)
        return n * per / sorted(runs)[2]

    return rate(CopyPlan(swap_in=pairs)), rate(CopyPlan(swap_out=pairs))
