"""Named settings of the serving benchmark: the CPU preset (`make bench`) and the GPU ones."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Mode:
    """One line of the plot: how the engine keeps (or not) the conversations' KV."""

    name: str
    cache_mode: str = "pensieve"
    eviction: str = "pensieve"
    unified: bool = True
    # The oracle: a second tier that holds every conversation (never drops one), beside the
    # same GPU tier, so it runs the same batches on the same GPU: the most keeping KV can
    # give there. `gpu_holds_all`: the GPU tier holds them all too (no swaps, and batches no
    # GPU of that size could run): not a cache's bound, the most any memory could give.
    holds_all: bool = False
    gpu_holds_all: bool = False
    disk: bool = False  # a disk tier (a fresh directory; none simulated) behind the CPU tier
    # Sliding layers keep only their window (EngineConfig.window_savings); off: every layer's
    window_savings: bool = True


MODES = {
    m.name: m
    for m in (
        Mode("pensieve"),
        Mode("gpu", cache_mode="gpu"),
        Mode("stateless", cache_mode="stateless"),
        Mode("pensieve-lru", eviction="lru"),
        Mode("pensieve-returns", eviction="returns"),
        Mode("pensieve-separate", unified=False),
        Mode("oracle", holds_all=True),
        Mode("oracle-gpu", holds_all=True, gpu_holds_all=True),
        Mode("pensieve-disk", disk=True),
        Mode("pensieve-every-layer", window_savings=False),
    )
}


@dataclass
class Preset:
    name: str
    model: str
    device: str | None = None
    dtype: str | None = None
    kv_dtype: str = "auto"  # fp8 / int8: 8-bit KV, pools sized for the same bytes as auto
    compile_cpu: bool = False  # the CPU forward compiled by Inductor (EngineConfig.compile_cpu)
    conversations: int = 100
    rates: list[float] = field(default_factory=lambda: [0.5, 1.0])  # new conversations / s
    think_s: list[float] = field(default_factory=lambda: [60.0])  # mean user think time
    time_scale: float = 1.0  # every planned time (arrivals, think) is multiplied by this
    context_cap: int = 16384
    max_output: int = 1024
    min_turns: int = 1
    max_turns: int | None = None
    min_context: int = 0  # skip conversations shorter than this (after the caps)
    modes: list[str] = field(default_factory=lambda: ["pensieve", "gpu", "stateless"])
    gpu_cache_chunks: int | None = None
    cpu_cache_chunks: int | None = None
    gpu_fraction: float | None = None  # first tier = this share of the sample's history
    gpu_cache_gb: float | None = None  # sizes the pool from the model's KV bytes per chunk
    cpu_cache_gb: float | None = None
    disk_cache_gb: float | None = None  # GiB, as the tiers (None: the engine's default)
    max_batch_tokens: int = 2048
    max_running: int = 256
    # Capacity: the throughput where a mode's MEAN normalized latency (s / output token)
    # reaches this bound, interpolated between the runs either side (p90: a second figure).
    latency_bound: float = 0.5
    stop_past_bound: float = 1.0  # stop a mode's sweep once its mean passes bound x this
    max_rate: float | None = None  # past the listed rates, double the rate up to this until crossed
    seed: int = 0
    threads: int | None = None  # torch intra-op threads; None: torch's default
    # A tokenized sample to replay (no tokenizer or dataset needed), relative to the checkout
    # (bench/samples/); None: draw from ShareGPT.
    sample_file: str | None = None
    # The simulator's steady state (None: measure the whole run, as bench.serve does): at
    # each rate, conversations (the sample repeated) arrive for this many seconds, and the
    # turns sent after `warmup` of it are measured, until the last arrival.
    arrival_s: float | None = None
    warmup: float = 0.3
    dry: bool = False  # a dry run: short pieces of a few turns (the plumbing, not the figures)
    note: str = ""


# The paper's setting: Llama 2-13B shape with GQA (random weights), 40 GB GPU KV pool,
# the paper's 200 GB CPU pool (or 60% of the host's RAM), ShareGPT contexts up to 16384
# tokens, replies up to 1024. Think times are compressed 10x (60 s replayed as 6 s) so a
# mode's sweep fits in one command of under 10 minutes; 200 conversations hold ~1.5x the
# GPU pool's tokens once they have all arrived. `--think 600` and `--time-scale 1` give the
# paper's other settings (much longer runs).
GPU = Preset(
    name="gpu",
    model="dummy:llama-2-13b-gqa10",
    device="cuda",
    dtype="bfloat16",
    conversations=200,
    rates=[2.0, 4.0, 8.0],
    think_s=[60.0],
    time_scale=0.1,
    context_cap=16384,
    max_output=1024,
    modes=["pensieve", "stateless", "gpu"],
    gpu_cache_gb=40.0,
    cpu_cache_gb=200.0,
    latency_bound=0.18,
    max_rate=32.0,
    # Drawn with `--save-sample bench/samples/gpu.json --conversations 1600` from this
    # preset: it replays the first 200, the GPU report's serve part all 1,600.
    sample_file="bench/samples/gpu.json",
    note="think time x0.1; CPU pool: 200 GB or 60% of host RAM, whichever is smaller",
)


PRESETS: dict[str, Preset] = {
    # SmolLM2-135M in float32 on a 2-core CPU, one torch thread (two spin against any other
    # load). 48 ShareGPT conversations with at least 600 tokens of context, 3-4 turns,
    # contexts capped at 1024 tokens and replies at 16; think time 60 s replayed as 3 s
    # (x0.05). The first tier holds half the history. Each mode's sweep goes on (doubling the
    # rate) until its mean normalized latency crosses the bound.
    "cpu": Preset(
        name="cpu",
        model="smollm2-135m-instruct",
        device="cpu",
        dtype="float32",
        # 48 conversations: the replay is closed-loop, so its load is bounded by how many
        # conversations it holds. With 12, and then 24, every rate from about 1/s on had all
        # of them in flight at once: throughput and latency went flat and no mode crossed.
        conversations=48,
        rates=[0.25, 0.5, 1.0, 2.0],
        max_rate=8.0,
        think_s=[60.0],
        time_scale=0.05,
        context_cap=1024,
        max_output=16,
        min_turns=3,
        max_turns=4,
        min_context=600,
        modes=["pensieve", "gpu", "stateless", "pensieve-separate"],
        gpu_fraction=0.5,
        max_batch_tokens=512,
        # Mean s/token: the bound this preset always had (2.5 s/token, then on the p90),
        # now on the mean as the paper does; the sweep goes on until each mode crosses it.
        # (1.0 was tried once: pensieve was over it at the lowest rate, 0.25/s.)
        latency_bound=2.5,
        threads=1,
        note="think time 60 s replayed as 3 s (x0.05); context cap 1024, reply cap 16 tokens",
    ),
    "gpu": GPU,
    # Llama 3 8B's KV is smaller (128 KiB a token against 200 KiB): the same 200
    # conversations fit its 40 GB pool, so it shows the stateless comparison, not tier 2.
    "gpu-llama3": replace(GPU, name="gpu-llama3", model="dummy:llama-3-8b"),
    # A few seconds: the smoke test and a quick check of a checkout.
    "tiny": Preset(
        name="tiny",
        model="dummy:tiny",
        device="cpu",
        dtype="float32",
        conversations=3,
        rates=[4.0],
        think_s=[0.5],
        context_cap=512,
        max_output=8,
        max_turns=3,
        modes=["pensieve", "stateless"],
        gpu_cache_chunks=64,
        cpu_cache_chunks=64,
        max_batch_tokens=256,
        latency_bound=1.0,
    ),
}


# The paper's two settings for the simulator (`bench.sim`): think times as they are (60 s,
# and 600 s with --think), many more conversations than a real run could replay, and the
# paper's latency bounds. OPT-13B's positions stop at 2048 tokens: contexts are capped there.
PAPER = replace(
    GPU,
    name="paper-gqa",
    conversations=600,
    rates=[0.25, 0.5, 1.0, 2.0],
    max_rate=64.0,
    time_scale=1.0,
    modes=["pensieve", "stateless", "gpu", "pensieve-lru", "oracle"],
    sample_file=None,
    # Arrivals for 20 minutes at each rate (the 600-conversation sample repeated past 0.5/s),
    # the last 14 measured: past the ramp-up, as long as a conversation's turns last.
    arrival_s=1200.0,
    note="simulated; think time as recorded",  # the plot adds the tiers and the window
)
PRESETS["paper-gqa"] = PAPER
PRESETS["paper-opt"] = replace(
    PAPER, name="paper-opt", model="dummy:opt-13b", context_cap=2048, latency_bound=0.12
)


def floats(text: str) -> list[float]:
    """A comma-separated list of numbers from the command line."""
    return [float(x) for x in text.split(",")]


def with_changes(preset: Preset, **changes: Any) -> Preset:
    """The preset with the changes given (None: left as it is): command-line overrides."""
    return replace(preset, **{k: v for k, v in changes.items() if v is not None})


def dry_run(preset: Preset) -> Preset:
    """The preset's plumbing on the CPU in seconds: dummy:tiny, tiny tiers, three
    conversations cut to short pieces. Its numbers mean nothing."""
    return replace(
        preset,
        model="dummy:tiny",
        device="cpu",
        dtype="float32",
        conversations=3,
        rates=[4.0],
        max_rate=None,
        think_s=[0.5],
        time_scale=1.0,
        gpu_cache_chunks=16,
        cpu_cache_chunks=32,
        gpu_cache_gb=None,
        cpu_cache_gb=None,
        gpu_fraction=None,
        max_batch_tokens=256,
        latency_bound=1.0,
        threads=None,
        dry=True,
    )
