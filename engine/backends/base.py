"""What an engine runs on, behind one interface: the model's shape, the KV pool, the runner,
the Cost(l) the eviction policy reads, the disk tier and the reads off the step loop.

`Engine` is built over one `Backend` and never asks which kind it is: one process
(`local.py`), tensor-parallel ranks (`parallel.py`) or a simulated device (`simulated.py`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from engine.cache.policy import CostModel
from engine.disk.index import DiskIndex
from engine.guide import Guides
from engine.kv_layout import KVLayout
from engine.kv_pool import KVPool
from engine.model.shapes import ModelArgs
from engine.types import CacheMode, EngineConfig


def memory_tiers(bytes_per_block: int, gpu: int | None, device: torch.device) -> tuple[int, int]:
    """Tiers in blocks from free memory: the GPU's less room for activations (1 GiB on the
    CPU), and the CPU tier up to 40% of the host's free memory, at most 4x the GPU tier."""
    if gpu is None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        gpu = int(free * 0.85 - (2 << 30)) // bytes_per_block
    elif gpu is None:
        gpu = max(64, (1 << 30) // bytes_per_block)
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):
        host = 8 << 30
    return gpu, min(int(host * 0.4) // bytes_per_block, 4 * gpu)


class Backend:
    """The parts an engine is built from. Subclasses set the fields in `__init__` and give
    the pool, the runner, the policy's Cost(l) and the disk tier."""

    device: torch.device  # where the engine's own tensors live (a simulation: the CPU)
    dtype: torch.dtype
    args: ModelArgs  # the whole model's shape
    pool_args: ModelArgs  # the KV heads one pool holds (a rank's share)
    model: Any = None  # the forward's module (None: nothing runs for real)
    tokenizer: Any = None
    stop_token_ids: tuple[int, ...] | list[int] = ()
    attention: str | None = None  # the kernels' backend: "triton" | "torch"
    gpu: bool = False  # a GPU (real or simulated): the GPU defaults of prefetch apply
    keeps_disk: bool = True  # the disk tier outlives the process (write it back at close)
    tp: Any = None  # tensor-parallel ranks (engine/parallel.py), where there are any

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.now: Callable[[], float] = time.time
        self._reader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="history")

    # ---- building the engine's parts ---------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        """Bytes one chunk takes in either tier (a rank's share of its KV heads)."""
        c = self.config
        return KVPool.bytes_per_block(self.pool_args, c.chunk_size, self.dtype, c.kv_dtype)

    def default_tiers(self, gpu: int | None) -> tuple[int, int]:
        """Tiers in blocks when the config leaves them out (`gpu`: the GPU tier's where it
        is given)."""
        return memory_tiers(self.bytes_per_block, gpu, self.device)

    def tier_sizes(self) -> tuple[int, int]:
        """Tiers in blocks: the config's, else from memory; no CPU tier but in pensieve mode."""
        c = self.config
        gpu, cpu = self.default_tiers(c.gpu_cache_chunks)
        cpu = cpu if c.cpu_cache_chunks is None else c.cpu_cache_chunks
        if c.cache_mode != CacheMode.PENSIEVE:
            cpu = 0
        if gpu < 2:
            raise ValueError(f"the KV pool holds only {gpu} blocks: not enough memory")
        return gpu, cpu

    def pool(self, gpu_blocks: int, cpu_blocks: int, layout: KVLayout):
        """The KV pool of that many pages (blocks) per tier, laid out by `layout`."""
        raise NotImplementedError

    def runner(self, pool):
        raise NotImplementedError

    def policy_cost(self, max_context: int) -> CostModel:
        """Cost(l) of recomputing a chunk, as the eviction policy reads it."""
        raise NotImplementedError

    def disk(self, cost: CostModel, bytes_per_chunk: int) -> DiskIndex:
        """The disk tier's store of chunks (the engine holds it in a `DiskTier`)."""
        raise NotImplementedError

    def guides(self) -> Guides | None:
        """Constrained decoding (None: this backend samples no real tokens)."""
        return Guides(self.tokenizer, self.args.vocab_size, self.stop_token_ids)

    def finish(self, runner, pool, max_context: int, gpu_blocks: int) -> None:
        """Once the pool and runner exist: what needs them (compiling, graphs)."""

    # ---- reads off the step loop -------------------------------------------------------------

    def read_later(self, disk: DiskIndex | None, fn: Callable[..., Any], *args: Any) -> Future:
        """`fn(*args)` (a history and disk tier read) on a reader thread."""
        return self._reader.submit(fn, *args)

    def wait_for_reads(self, reads: list, timeout: float) -> None:
        """Nothing could be scheduled: wait until one of `reads` ends (or a little)."""
        if reads:
            wait(reads, timeout=timeout)
        else:
            time.sleep(timeout / 10)

    def next_read_s(self, reads: list) -> float | None:
        """When the first read still running ends, where time is virtual (None: it is not)."""
        return None

    def pin(self, parts: dict) -> dict:
        """Chunks read from disk, ready for their copy to the pool."""
        return parts

    def use_device(self) -> None:
        """Make the engine's GPU the calling thread's current one."""

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)
