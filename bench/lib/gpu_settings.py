"""The GPU report's settings and what its parts and their simulated twins share: the sample,
the tiers of each part, whether they fit a machine, the label of a simulated device."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from bench.lib import steady as st
from bench.lib import workload as wl
from bench.lib.common import ROOT, SAMPLES, host_memory_gb
from bench.lib.flops import linear_flops_per_token
from bench.lib.pools import (
    PINNED_SHARE,
    chunks_in,
    engine_config,
    holds_all,
    kv_bytes_per_chunk,
    model_args,
)
from bench.lib.presets import MODES, Preset
from bench.lib.samples import read_sample
from engine import Engine
from engine.sim.devices import VERSIONS

SERVE_MODES = ("stateless", "gpu", "pensieve")  # in this order: each next should serve more
STEADY_MODES = (*SERVE_MODES, "oracle")
SAMPLE = SAMPLES / "gpu.json"
# What a real part spends besides its runs' windows and drains (the H200's serve part,
# ba0cc72: 394 s in all for 7 runs of 370 s): each engine's start, and per run the settling
# sleep and freeing its conversations.
ENGINE_START_S = 7.0
RUN_OVERHEAD_S = 1.0
# The page-locking of a CPU tier at the engine's start, assumed
# (the serve part's 12.5 GiB tier started within those 7 s; not measured apart)
PIN_S_PER_GIB = 0.25
# The lent machines (bench/README.md, "With a GPU for 15 minutes"): GPU memory as torch
# reports it, and the host's RAM
LENT_GPU_BYTES = {"h100": 85.0e9, "h200": 150.0e9, "a100-80gb": 85.0e9, "cpu": math.inf}
LENT_HOST_GIB = 128.0


@dataclass
class Settings:
    model: str = "dummy:llama-2-13b-gqa10"
    device: str = "cuda"
    dtype: str = "bfloat16"
    budget_s: float = 510.0  # per part: no run starts that would end later than this
    # mfu
    prompts: list[int] = field(default_factory=lambda: [512, 2048, 8192])
    mfu_requests: int = 4
    mfu_repeats: int = 3
    matmul_sizes: list[int] = field(default_factory=lambda: [4096, 8192])
    # decode
    batches: list[int] = field(default_factory=lambda: [1, 16, 64, 256])
    contexts: list[int] = field(default_factory=lambda: [1024, 4096])
    decode_steps: int = 20
    copy_mib: int = 4096
    # decode of a mixture-of-experts shape after the dense one (about 30 s on an H100): its
    # roofline counts the weights a step reads ("" leaves it out)
    moe_model: str = "dummy:qwen3-30b-a3b"
    moe_batches: list[int] = field(default_factory=lambda: [1, 64])
    moe_context: int = 1024
    # serve
    sample: str = str(SAMPLE.relative_to(ROOT))  # relative to the checkout
    # Sized with the simulator (`python -m bench.sim --gpu-serve --device h100`): at 32/s a
    # 45 s window draws 1,440 new conversations, so the sample lasts the whole window at
    # every rate up to there. 200 ran out at 16/s and no mode crossed the bound on an H200.
    conversations: int = 1600
    think_s: float = 60.0
    scale: float = 4.0  # k: think time / k, both tiers / k
    gpu_cache_gb: float = 40.0  # unscaled tiers, as in the paper
    cpu_cache_gb: float = 200.0
    bound: float = 0.18  # mean normalized latency, s / output token
    rates: list[float] = field(
        default_factory=lambda: [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0]
    )
    # The first mode's sweep starts here. The simulated H100 puts every mode's crossing
    # between 12 and 16/s, the simulated H200 between 16 and 24/s: from 16/s each mode's
    # sweep takes two runs on either (`python -m bench.sim --gpu-serve --device h200`).
    start_rate: float = 16.0
    window_s: float = 45.0
    # A run over the bound costs window + drain: 20 s keeps seven runs within the budget
    # (six are needed: a run under and one over for each mode).
    drain_s: float = 20.0
    unscaled_window_s: float = 180.0
    unscaled_drain_s: float = 60.0
    max_batch_tokens: int = 2048
    # steady: the paper's setting unscaled on one GPU, each run seeded with a steady state
    # the simulator computed beforehand (bench/lib/steady.py), one engine per mode
    steady_gpu_gb: float = 40.0
    # GiB, pinned: as large as a lent machine allows (60% of its 128 GiB is 76.8 GiB), with
    # room left for a host that reports a little less
    steady_cpu_gb: float = 72.0
    steady_think_s: float = 60.0
    steady_cut_s: float = 1200.0  # virtual seconds of the simulated warm-up before the cut
    steady_states: str = "bench/samples/steady"  # <mode>-<rate>.json, relative to the checkout
    # Per mode the last rate under the bound and the first over it, each in the part's own
    # run from the state the simulator's warm-up at that rate left, chosen by
    # `steady_rates_by` (bench/README.md, "The steady part"). Simulated mean normalized
    # latency of those runs (h100 model v3): stateless 41 / 334 ms, gpu-only 35 / 339,
    # pensieve 44 / 556
    steady_rates: dict[str, list[float]] = field(
        default_factory=lambda: {
            "stateless": [2.83, 3.36],
            "gpu": [2.83, 3.36],
            "pensieve": [3.36, 4.0],
        }
    )
    steady_rates_by: str = "python -m bench.sim --steady-states --device h100 --modes M"
    # Modes the simulator chose no rates for, and why (listed as skipped by the part)
    steady_skipped: dict[str, str] = field(
        default_factory=lambda: {
            "oracle": "its second tier (the whole history of every conversation arriving "
            "in the warm-up and the run: about 2.4 TB at 4.76/s) is over 60% of a lent "
            "machine's RAM"
        }
    )
    steady_warmup_s: float = 6.0  # each run: sent, not counted (the turns in flight go on)
    steady_window_s: float = 45.0  # then counted
    steady_drain_s: float = 15.0  # then turns still running are cut (at their lower bound)
    steady_budget_s: float = 480.0  # the whole part, engine starts included
    # profile: each mode's steps at one load (multi-turn waves that overflow the GPU tier),
    # and the copy rates of scattered chunks per direction
    profile_conversations: int = 32
    profile_prompt: int = 512  # first turn's prompt tokens
    profile_followup: int = 128  # each later turn's
    profile_output: int = 32  # tokens each turn generates
    profile_turns: int = 3  # the first fills the caches (and warms the kernels): not timed
    profile_gpu_chunks: int = 384  # ~half of the waves' 864 chunks of context
    profile_cpu_chunks: int = 1024  # pensieve's second tier holds them all
    profile_launch_steps: int = 3  # steps of each wave under torch.profiler
    profile_rate_chunks: int = 64
    profile_budget_s: float = 60.0  # the whole part, engine starts included
    dry: bool = False  # a CPU dry run: turns cut short, tiny tiers


def dry_settings(model: str) -> Settings:
    """Every part's plumbing on the CPU in a minute or two (numbers mean nothing)."""
    return Settings(
        model=model,
        device="cpu",
        dtype="float32",
        budget_s=120.0,
        prompts=[64, 128],
        mfu_requests=1,
        mfu_repeats=1,
        matmul_sizes=[128, 256],
        batches=[1, 4],
        contexts=[64, 128],
        decode_steps=3,
        copy_mib=16,
        moe_model="dummy:tiny-moe",
        moe_batches=[1, 4],
        moe_context=64,
        conversations=6,
        scale=30.0,  # think 2 s: returning turns within the short windows
        gpu_cache_gb=0.12,  # / k: ~32 chunks of dummy:tiny
        cpu_cache_gb=0.6,
        bound=0.1,
        rates=[2.0, 8.0],
        start_rate=2.0,
        window_s=3.5,
        drain_s=2.5,
        unscaled_window_s=3.5,
        unscaled_drain_s=2.5,
        max_batch_tokens=256,
        steady_gpu_gb=0.002,  # ~16 chunks of dummy:tiny, ~64 on the CPU tier
        steady_cpu_gb=0.008,
        steady_think_s=2.0,
        steady_cut_s=20.0,
        steady_states="",  # made by the simulator at the start of the dry run, under /tmp
        steady_rates={m: [2.0, 8.0] for m in STEADY_MODES},
        steady_skipped={},
        steady_warmup_s=0.5,
        steady_window_s=2.5,
        steady_drain_s=2.0,
        steady_budget_s=150.0,
        profile_conversations=6,
        profile_prompt=48,
        profile_followup=16,
        profile_output=4,
        profile_gpu_chunks=12,
        profile_cpu_chunks=48,
        profile_launch_steps=1,
        profile_rate_chunks=8,
        profile_budget_s=90.0,
        dry=True,
    )


def report_settings(settings: dict) -> Settings:
    """A report's `Settings`, replaying the committed sample of the same name (the report
    records the path it had on the GPU machine)."""
    known = Settings.__dataclass_fields__
    s = replace(Settings(), **{k: v for k, v in settings.items() if k in known})
    return replace(s, sample=str(SAMPLES / Path(s.sample).name))


def load_sample(s: Settings) -> tuple[list[wl.Conversation], dict[str, Any]]:
    """The committed sample; the dry run keeps short pieces of a few conversations that fit."""
    convs, info = read_sample(ROOT / s.sample)  # an absolute path stays as it is
    limit = model_args(s.model).max_context
    if s.dry:
        convs = wl.shorten(convs, prompt=40, output=6, turns=3)
    convs = [c for c in convs if c.context_lens()[-1] <= limit][: s.conversations]
    return convs, {**info, "summary": wl.summarize(convs)}


# ---- tiers -------------------------------------------------------------------------------


def chunks_of(s: Settings, gb: float) -> int:
    """Chunks of the report's model in `gb` GiB (at least 2)."""
    return max(2, chunks_in(gb, s.model, s.dtype))


def window_of(s: Settings, k: float) -> tuple[float, float]:
    """A run's window (seconds of turns sent) and drain (at most this long after it, then
    what still runs is cancelled): the unscaled run's are longer."""
    return (s.unscaled_window_s, s.unscaled_drain_s) if k == 1 else (s.window_s, s.drain_s)


def preset_for(s: Settings, k: float, oracle_chunks: int | None = None) -> Preset:
    """The engine settings of one scale: tiers / k (the oracle: the same GPU tier, and a
    second tier that holds everything: `bench.lib.presets.Mode` says why)."""
    cpu = chunks_of(s, s.cpu_cache_gb / k)
    if oracle_chunks is not None:
        cpu = max(cpu, oracle_chunks)
    return _preset(s, "gpu-report", s.gpu_cache_gb / k, cpu)


def steady_preset(s: Settings, mode: str, convs=None, rate: float | None = None) -> Preset:
    """The engine settings of the steady part: the unscaled tiers (the oracle's second tier
    holds every conversation arriving up to its last run's end, `steady_oracle_chunks`)."""
    cpu = chunks_of(s, s.steady_cpu_gb)
    if mode == "oracle":
        cpu = max(cpu, steady_oracle_chunks(s, convs, rate))
    return _preset(s, "gpu-report-steady", s.steady_gpu_gb, cpu)


def _preset(s: Settings, name: str, gpu_gb: float, cpu_chunks: int) -> Preset:
    return Preset(name=name, model=s.model, device=s.device, dtype=s.dtype,
                  gpu_cache_chunks=chunks_of(s, gpu_gb), cpu_cache_chunks=cpu_chunks,
                  max_batch_tokens=s.max_batch_tokens, latency_bound=s.bound)  # fmt: skip


def steady_oracle_chunks(s: Settings, convs: list[wl.Conversation], rate: float) -> int:
    """Tiers that never evict at `rate`: the whole context of every conversation that
    arrives in the warm-up and the run after it (+50%), +10% and 64 chunks."""
    n = st.warmup_plans_needed(rate, s.steady_cut_s)
    n += int(rate * (s.steady_warmup_s + s.steady_window_s) * 1.5) + 10
    return holds_all([st.nth(convs, k) for k in range(n)])


def oracle_chunks(s: Settings, convs: list[wl.Conversation], rate: float) -> int:
    """Tiers that never evict in a scaled run at up to `rate`: the whole context of every
    conversation that arrives within its window (not the whole sample), +10% and 64 chunks."""
    plans = wl.plan(convs, rate, s.think_s / s.scale, 0)
    came = [p.conversation for p in plans if p.arrival_s < s.window_s]
    return holds_all(came)


def simulated_engine(preset: Preset, mode: str, device: str, max_waiting: int | None = None):
    """An engine of `mode` with the preset's tiers on `device`'s cost model; its queue
    unbounded (`pools.BENCH_QUEUE`) unless `max_waiting` says."""
    config = engine_config(replace(preset, device=f"sim:{device}"), MODES[mode])
    return Engine(config if max_waiting is None else replace(config, max_waiting=max_waiting))


def state_mismatch(state, preset: Preset) -> str | None:
    """Why a state was not made for these tiers (None: it was)."""
    have = (state.gpu_cache_chunks, state.cpu_cache_chunks)
    want = (preset.gpu_cache_chunks, preset.cpu_cache_chunks)
    if state.mode == "stateless" or state.mode == "gpu":
        have, want = have[:1], want[:1]
    if state.mode == "oracle":  # never evicts: any tiers at least as large will do
        return None if min(w - h for w, h in zip(want, have, strict=True)) >= 0 else (
            f"state made for tiers {have}, larger than the part's {want}")  # fmt: skip
    return None if have == want else f"state made for tiers {have}, the part has {want}"


def steady_states(s: Settings, folder: Path, mode: str):
    """The mode's (rate, path, state) of each rate of `steady_rates`; missing ones listed."""
    got, missing = [], []
    for rate in s.steady_rates.get(mode, []):
        path = st.state_path(folder, mode, rate)
        if path.exists():
            got.append((rate, path, st.State.read(path)))
        else:
            missing.append(str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path))
    return got, missing


def steady_modes(s: Settings, convs, folder: Path, room, log) -> tuple[list, list[str]]:
    """The steady part's modes to run, each (mode, its tiers sized for its highest rate, its
    (rate, path, state) list), and those skipped, why: no rates, no state, tiers that do not
    fit (`room(gpu_chunks, cpu_chunks)`) or that its states were not made for."""
    todo, skipped = [], []
    for mode in STEADY_MODES:
        if mode in s.steady_skipped and not s.steady_rates.get(mode):
            skipped.append(f"{mode}: {s.steady_skipped[mode]}")
            continue
        states, missing = steady_states(s, folder, mode)
        if missing:
            skipped.append(f"{mode}: no state {', '.join(missing)}")
            log(f"skip {mode}: no state {missing}")
        if not states:
            continue
        preset = steady_preset(s, mode, convs, max(r for r, _, _ in states))
        cpu = preset.cpu_cache_chunks if MODES[mode].cache_mode == "pensieve" else 0
        why = room(preset.gpu_cache_chunks, cpu) or state_mismatch(states[0][2], preset)
        if why:
            skipped.append(f"{mode}: {why}")
            log(f"skip {mode}: {why}")
            continue
        todo.append((mode, preset, states))
    return todo, skipped


# ---- what fits a machine -------------------------------------------------------------------


def weight_bytes(a, element_size: int, batch: int = 1) -> int:
    """Bytes a decode step of `batch` tokens reads of the weights: every layer's projections
    and MLP and the LM head; of a MoE layer the attention, the router and the experts the
    batch touches (`experts_touched`), not all of them."""
    params = linear_flops_per_token(a) // 2 + a.dim * a.vocab_size  # top-k experts a layer
    moe_layers = sum(a.is_moe_layer(i) for i in range(a.n_layers))
    extra = experts_touched(a, batch) - a.top_k
    params += round(moe_layers * extra * 3 * a.dim * a.moe_intermediate_size)
    return params * element_size


def experts_touched(a, batch: int) -> float:
    """Distinct experts a MoE layer runs for `batch` tokens, expected under uniform routing
    (dummy weights route about uniformly): E (1 - (1 - k/E)^batch), between k and min(E, kB)."""
    if not a.n_experts:
        return 0.0
    return a.n_experts * (1 - (1 - a.top_k / a.n_experts) ** batch)


def room(s: Settings, gpu_chunks: int, cpu_chunks: int, gpu_bytes: float,
         host_gib: float | None) -> str | None:  # fmt: skip
    """Why these tiers cannot be allocated on a machine of `gpu_bytes` of GPU memory and
    `host_gib` of RAM (None: they can): the first beside the weights in 90% of the GPU's
    memory, the second (pinned) in 60% of the RAM (unknown RAM: not checked)."""
    per = kv_bytes_per_chunk(s.model, s.dtype)
    weights = weight_bytes(model_args(s.model), getattr(torch, s.dtype).itemsize)
    if gpu_chunks * per + weights > 0.9 * gpu_bytes:
        return (
            f"a first tier of {gpu_chunks * per / 1e9:.0f} GB does not fit beside "
            f"{weights / 1e9:.0f} GB of weights in {gpu_bytes / 1e9:.0f} GB of GPU memory"
        )
    if host_gib is not None and cpu_chunks * per > PINNED_SHARE * host_gib * 2**30:
        return (
            f"a second tier of {cpu_chunks * per / 1e9:.0f} GB (pinned) is over {PINNED_SHARE:.0%} of "
            f"{host_gib * 2**30 / 1e9:.0f} GB of RAM"
        )
    return None


def no_room(s: Settings, gpu_chunks: int, cpu_chunks: int) -> str | None:
    """`room` on this machine (a CPU run: always room)."""
    if not s.device.startswith("cuda"):
        return None
    gpu = torch.cuda.get_device_properties(torch.device(s.device)).total_memory
    return room(s, gpu_chunks, cpu_chunks, gpu, host_memory_gb())


def lent_room(s: Settings, device: str, gpu_chunks: int, cpu_chunks: int) -> str | None:
    """`room` on the lent machine of a simulated `device`."""
    gpu = LENT_GPU_BYTES.get(device, math.inf)
    return room(s, gpu_chunks, cpu_chunks, gpu, LENT_HOST_GIB)


# ---- simulated ----------------------------------------------------------------------------


def label(device: str) -> str:
    return f"SIMULATED {device} (cost model v{VERSIONS[device]})"
