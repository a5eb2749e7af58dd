"""Tensor-parallel ranks: this process is rank 0 and holds its share of the model and of
every chunk; the other ranks are worker processes (engine/parallel.py)."""

from __future__ import annotations

import logging

from engine.backends.local import Local
from engine.kv_layout import KVLayout
from engine.model.loader import Loaded
from engine.parallel import ParallelPool, ParallelRunner, TensorParallel

log = logging.getLogger(__name__)


class Parallel(Local):
    """Rank 0's side: one plan per step, run by every rank on its own shard."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.pool_args = self.tp.args  # a rank's KV heads
        self.profile_name = self.tp.profile_name  # Cost(l) times one rank's shard

    def setup(self) -> None:
        self.tp = TensorParallel(self.config, self.device, self.dtype)
        self.device = self.tp.device  # rank 0's own GPU, with its index

    def load(self) -> Loaded:
        return self.tp.load()  # rank 0's shard; args stay the full model's

    def pool(self, gpu_blocks: int, cpu_blocks: int, layout: KVLayout) -> ParallelPool:
        return self.tp.pool(gpu_blocks, cpu_blocks, self.attention, layout)

    def runner(self, pool: ParallelPool) -> ParallelRunner:
        return self.tp.runner(self.model, pool, self.attention)

    @property
    def graphs_enabled(self) -> bool:
        return False  # captured graphs would skip the step messages to the other ranks

    def compile_cpu(self, runner, pool) -> None:
        log.warning("compile_cpu serves a CPU model over a 16-bit or float32 pool, one rank")

    def close(self) -> None:
        super().close()
        self.tp.close()
