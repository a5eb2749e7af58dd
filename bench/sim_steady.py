"""The GPU report's steady part in virtual time (`python -m bench.sim`): its states, the
choice of its rates, its rehearsal and its twin. Every figure here is SIMULATED.

    python -m bench.sim --steady-states --device h100 [--modes pensieve]   # states and rates
    python -m bench.sim --gpu-steady --device h100        # the part rehearsed: time, crossings

`choose` walks a ladder of rates 2^(1/4) apart per mode (`bench/lib/sweep.py`), a warm-up at each
(`bench/lib/steady.py`) and the part's run from its state, until an adjacent pair brackets
the bound; their states are written to `steady_states` (the rates go into
`Settings.steady_rates` by hand). `twin` runs a real report's steady runs again from their
states; the part itself is rehearsed from the same files by `sim_serve.rehearse`.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.lib import steady as st
from bench.lib import versus
from bench.lib import workload as wl
from bench.lib.common import ROOT, git_commit
from bench.lib.gpu_settings import (
    STEADY_MODES,
    label,
    lent_room,
    load_sample,
    report_settings,
    simulated_engine,
    state_mismatch,
    steady_preset,
)
from bench.lib.metrics import run_line
from bench.lib.replay import Virtual, steady_run
from bench.lib.sweep import over, sweep

# Rungs 2^(1/4) apart (x1.19): a bracket this narrow is 9% either side of the crossing.
LADDER = [round(2 ** (i / 4), 2) for i in range(0, 25)]  # 1 ... 64
# Where each mode's walk starts (on the h100 model v3 the part's pairs are 2.83-3.36/s
# stateless and gpu-only, 3.36-4/s pensieve)
START = {"stateless": 2.83, "gpu": 2.83, "pensieve": 3.36, "oracle": 4.0}


def _log(*a) -> None:
    print(*a, flush=True)


def _engine(s, mode: str, device: str, convs, rate: float):
    preset = steady_preset(s, mode, convs, rate)
    return simulated_engine(preset, mode, device), preset


def warm_up(s, mode: str, rate: float, device: str, convs, log=_log) -> st.State:
    """The warm-up at `rate` on a simulated engine of its own, cut at `steady_cut_s`."""
    engine, preset = _engine(s, mode, device, convs, rate)
    n = st.warmup_plans_needed(rate, s.steady_cut_s)
    t = time.perf_counter()
    try:
        rows, nxt, cut, metrics, summary = st.warm_up(
            engine, [st.nth(convs, k) for k in range(n)], rate, s.steady_think_s, 0,
            s.steady_cut_s,
        )  # fmt: skip
    finally:
        engine.close()
    summary["real_s"] = time.perf_counter() - t
    state = st.State(
        mode=mode,
        rate=rate,
        think_s=s.steady_think_s,
        cut_s=cut,
        seed=0,
        sample=s.sample,
        sample_size=len(convs),
        next_index=nxt,
        gpu_cache_chunks=preset.gpu_cache_chunks,
        cpu_cache_chunks=preset.cpu_cache_chunks,
        chunk_size=32,
        rows=rows,
        simulated=label(device),
        git_commit=git_commit(),
        summary=summary,
        warmup_metrics=metrics,
    )
    line = run_line({"mode": mode, "think_s": s.steady_think_s, "rate": rate, "metrics": metrics})
    log(line + f"  [warm-up {cut:.0f} s: {summary['live']} live, {summary['real_s']:.0f}s real]")
    return state


def steady_folder(s, convs: list[wl.Conversation]) -> Path:
    """Where the part's states are: committed (`steady_states`), or, for a dry run, made
    now by the simulator in a temporary folder (seconds on dummy:tiny)."""
    if s.steady_states:
        return ROOT / s.steady_states
    folder = Path(tempfile.mkdtemp(prefix="pensieve-steady-"))
    make_states(s, "h100", STEADY_MODES, folder, convs, log=lambda *a: None)
    return folder


def make_states(s, device: str, modes, folder: Path, convs, log=_log) -> dict[str, Any]:
    """The states at `steady_rates` as they are (no walk): the dry run's."""
    out = {}
    for mode in modes:
        for rate in s.steady_rates.get(mode, []):
            state = warm_up(s, mode, rate, device, convs, log)
            out[f"{mode}-{rate:g}"] = str(state.write(st.state_path(folder, mode, rate)))
    return out


def _reusable(path: Path, s, mode: str, rate: float, device: str) -> st.State | None:
    """A state written earlier for the same mode, rate, think time, cut, tiers and cost
    model (an interrupted walk goes on from there)."""
    if not path.exists():
        return None
    state = st.State.read(path)
    same = (state.mode, state.rate, state.think_s, state.simulated) == (
        mode, rate, s.steady_think_s, label(device))  # fmt: skip
    return state if same and state.cut_s >= s.steady_cut_s else None


def choose(s, device: str, modes, folder: Path, start: float | None = None, log=_log):
    """Per mode, the pair of ladder rates that brackets the bound in the part's own runs
    (each warm-up's state resumed as the part resumes it, `run_from`), walking from `start`
    (else `START`); each warm-up's state written to `folder` as it ends (a walk cut short
    goes on from them), those outside the pair removed at the end."""
    convs, _ = load_sample(s)
    chosen, runs, skipped = {}, [], []
    for mode in modes:
        rate0 = start or START.get(mode, 4.0)
        preset = steady_preset(s, mode, convs, rate0 * 2 ** (1 / 4))
        cpu = preset.cpu_cache_chunks if mode not in ("stateless", "gpu") else 0
        why = lent_room(s, device, preset.gpu_cache_chunks, cpu)
        if why:
            skipped.append(f"{mode}: {why}")
            log(f"skip {mode}: {why}")
            continue
        past: dict[float, bool] = {}  # rate -> its run was over the bound

        async def at(rate: float, mode: str = mode, past: dict = past) -> dict[str, Any]:
            path = st.state_path(folder, mode, rate)
            state = _reusable(path, s, mode, rate, device)
            if state is None or state_mismatch(state, steady_preset(s, mode, convs, rate)):
                state = warm_up(s, mode, rate, device, convs, log)
                state.write(path)
            else:
                log(f"{mode} at {rate:g}/s: the state in {path.name} (made at {state.git_commit})")
            run = await _run_from(s, mode, state, path, convs, device)
            log(run_line(run) + "  [the part's run from it]")
            past[rate] = over(run, s.bound)
            runs.append({"mode": mode, "rate": rate, "warm_up": state.warmup_metrics,
                         "run": run["metrics"], "summary": state.summary,
                         "git_commit": state.git_commit})  # fmt: skip
            return run

        i = min(range(len(LADDER)), key=lambda j: abs(LADDER[j] - rate0))
        asyncio.run(sweep(at, LADDER, s.bound, start=i))
        under = [r for r, was in past.items() if not was]
        above = [r for r, was in past.items() if was]
        if under and above and LADDER.index(min(above)) - LADDER.index(max(under)) == 1:
            chosen[mode] = [max(under), min(above)]
            log(f"{mode}: {max(under):g}/s under, {min(above):g}/s over")
        else:
            log(f"{mode}: the ladder ended before the bound was bracketed")
        for rate in past:  # only the pair stays
            if rate not in chosen.get(mode, []):
                st.state_path(folder, mode, rate).unlink(missing_ok=True)
    return {"rates": chosen, "warm_ups": runs, "skipped": skipped, "settings": asdict(s)}


def run_from(
    s, mode: str, state: st.State, path: Path, convs, device: str, top: float | None = None
) -> dict[str, Any]:
    """One run of the part from `state` on a simulated engine of its own (`top`: the rate
    the oracle's tiers are sized for)."""
    return asyncio.run(_run_from(s, mode, state, path, convs, device, top))


async def _run_from(s, mode: str, state: st.State, path: Path, convs, device: str,
                    top: float | None = None) -> dict[str, Any]:  # fmt: skip
    engine, _ = _engine(s, mode, device, convs, top or state.rate)
    try:
        return await steady_run(Virtual(engine), s, mode, state, path, convs)
    finally:
        engine.close()


# ---- the twin of a real part ------------------------------------------------------------


def twin(report: dict, device: str = "h100", log=_log) -> dict[str, Any]:
    """The steady runs of a GPU report again on a simulated device, each from the same
    state file (the committed one of the report's name), rate, warm-up and window; the
    error of the simulation against each run and each capacity."""
    s = report_settings(report["settings"])
    if report["settings"].get("steady_states"):
        s = replace(s, steady_states=report["settings"]["steady_states"])
    convs, _ = load_sample(s)
    folder = steady_folder(s, convs)
    runs, points = [], []
    for real in report["steady"]["runs"]:
        mode = real["mode"]
        path = folder / real["state"]
        if not path.exists():
            log(f"no state {path}: {mode} at {real['rate']:g}/s not simulated")
            continue
        state = st.State.read(path)
        top = max(x["rate"] for x in report["steady"]["runs"] if x["mode"] == mode)
        run = run_from(s, mode, state, path, convs, device, top)
        runs.append(run)
        points.append({"mode": mode, "rate": real["rate"], **versus.points(real, run)})
        log(run_line(run) + f"  (real {real['metrics']['norm_latency_mean'] * 1e3:.1f} "
            "ms/tok)")  # fmt: skip
    caps = versus.capacities(report["steady"]["runs"], runs, s.bound, at_least=False)
    return {"simulated": label(device), "runs": runs, "points": points, "capacity": caps}
