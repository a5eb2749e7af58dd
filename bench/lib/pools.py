"""Engine settings of a benchmark preset: the EngineConfig of a mode, and tier sizes in
chunks from GB or from the sample's history (no weights loaded)."""

from __future__ import annotations

import tempfile
from dataclasses import replace

import torch

from bench.lib import workload as wl
from bench.lib.common import host_memory_gb
from bench.lib.presets import Mode, Preset
from engine import EngineConfig
from engine.kv_pool import KVPool
from engine.model.loader import model_args  # the shape, no weights loaded
from engine.sim import is_simulated

# A benchmark measures capacity, not the queue: past the server's usual limit (256 turns) a
# turn waits, and its latency says so, instead of being refused and ending its conversation
# (on an H100 at 16/s every mode refused ~180 turns, and those runs measured nothing).
BENCH_QUEUE = 1 << 20
PINNED_SHARE = 0.6  # of the host's RAM: the most a pinned CPU tier takes


def engine_config(preset: Preset, mode: Mode):
    disk: dict = {}
    if mode.disk:  # a simulated disk tier has no files: its directory is only a switch
        sim = is_simulated(preset.device)
        disk["disk_cache_dir"] = "simulated" if sim else tempfile.mkdtemp(prefix="pensieve-disk-")
        if preset.disk_cache_gb is not None:  # the engine's GB are 1e9 bytes
            disk["disk_cache_gb"] = preset.disk_cache_gb * 2**30 / 1e9
    return EngineConfig(
        model=preset.model,
        device=preset.device,
        dtype=preset.dtype,
        kv_dtype=preset.kv_dtype,
        compile_cpu=preset.compile_cpu,
        gpu_cache_chunks=preset.gpu_cache_chunks,
        cpu_cache_chunks=preset.cpu_cache_chunks if mode.cache_mode == "pensieve" else 0,
        cache_mode=mode.cache_mode,
        eviction=mode.eviction,
        unified=mode.unified,
        window_savings=mode.window_savings,
        max_batch_tokens=preset.max_batch_tokens,
        max_running=preset.max_running,
        max_waiting=BENCH_QUEUE,
        seed=preset.seed,
        **disk,
    )


def size_pools(preset: Preset, host: bool = True) -> Preset:
    """Turn the preset's GB pool sizes into chunk counts from the model's KV bytes per chunk.
    `host`: the CPU tier is capped by this machine's memory (not in a simulation)."""
    if preset.gpu_cache_gb is None and preset.cpu_cache_gb is None:
        return preset
    dtype = preset.dtype or "bfloat16"
    gpu, cpu = preset.gpu_cache_chunks, preset.cpu_cache_chunks
    if preset.gpu_cache_gb is not None:
        gpu = chunks_in(preset.gpu_cache_gb, preset.model, dtype, preset.kv_dtype)
    if preset.cpu_cache_gb is not None:
        gb = _cpu_pool_gb(preset.cpu_cache_gb) if host else preset.cpu_cache_gb
        cpu = chunks_in(gb, preset.model, dtype, preset.kv_dtype)
    return replace(preset, gpu_cache_chunks=gpu, cpu_cache_chunks=cpu)


def chunks_in(gib: float, model: str, dtype: str, kv_dtype: str = "auto") -> int:
    """Chunks of the model's KV in `gib` GiB."""
    return int(gib * 2**30 // kv_bytes_per_chunk(model, dtype, kv_dtype))


def holds_all(convs: list[wl.Conversation]) -> int:
    """A tier that never evicts these conversations: their whole history, +10% and 64 chunks."""
    return int(history_chunks(convs) * 1.1) + 64


def kv_bytes_per_chunk(model: str, dtype: str, kv_dtype: str = "auto", chunk_size: int = 32) -> int:
    """K and V bytes of one chunk across all layers (8-bit: with its scales), from the shape."""
    return KVPool.bytes_per_block(model_args(model), chunk_size, getattr(torch, dtype), kv_dtype)


def _chunks(conv: wl.Conversation, chunk: int) -> int:
    """Chunks that the conversation's full context takes."""
    return -(-conv.context_lens()[-1] // chunk)


def history_chunks(convs: list[wl.Conversation], chunk: int = 32) -> int:
    """Chunks that every conversation's full context takes: the idle history at its largest."""
    return sum(_chunks(c, chunk) for c in convs)


def fit_pools(preset: Preset, convs: list[wl.Conversation], chunk: int = 32) -> Preset:
    """First tier = gpu_fraction of the sample's history (at least room for the longest
    conversation twice over); the second tier holds all of it. Sized in bytes of the
    model's own dtype: an 8-bit KV gets the chunks that the same bytes hold. A tier given
    in chunks (`--gpu-chunks`, `--cpu-chunks`) is kept as given."""
    total = history_chunks(convs, chunk)
    longest = max(_chunks(c, chunk) for c in convs)
    gpu = max(int(total * preset.gpu_fraction), 2 * longest + 2)
    cpu = max(total, gpu)
    if preset.kv_dtype != "auto":
        dtype = preset.dtype or "bfloat16"
        per = kv_bytes_per_chunk(preset.model, dtype, chunk_size=chunk)
        per8 = kv_bytes_per_chunk(preset.model, dtype, preset.kv_dtype, chunk)
        gpu, cpu = gpu * per // per8, cpu * per // per8
    return replace(
        preset,
        gpu_cache_chunks=gpu if preset.gpu_cache_chunks is None else preset.gpu_cache_chunks,
        cpu_cache_chunks=cpu if preset.cpu_cache_chunks is None else preset.cpu_cache_chunks,
    )


def for_mode(preset: Preset, mode: Mode, convs: list[wl.Conversation]) -> Preset:
    """The preset a mode runs: the oracle's second tier (and `oracle-gpu`'s first) holds
    every conversation of the sample."""
    if not mode.holds_all:
        return preset
    every = holds_all(convs)
    gpu = preset.gpu_cache_chunks or 0
    return replace(
        preset,
        gpu_cache_chunks=max(gpu, every) if mode.gpu_holds_all else preset.gpu_cache_chunks,
        cpu_cache_chunks=max(preset.cpu_cache_chunks or 0, every),
    )


def _cpu_pool_gb(wanted: float) -> float:
    """The paper's CPU pool when the host has the memory, else 60% of the host's RAM."""
    host = host_memory_gb()
    return wanted if host is None else min(wanted, PINNED_SHARE * host)
