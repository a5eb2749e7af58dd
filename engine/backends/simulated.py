"""A simulated device (`EngineConfig(device="sim:h100")`): no model, its shape only; the
device's cost model and a virtual clock in place of the forward and the copies
(engine/sim/). The scheduler, cache and policy above it are the real ones."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from engine.backends.base import Backend
from engine.backends.local import DTYPES
from engine.cache.policy import CostModel
from engine.calibrate import Build, cpu_device
from engine.disk.index import DiskIndex
from engine.kv_layout import KVLayout
from engine.model.loader import model_args
from engine.sim import PREFIX
from engine.sim.clock import VirtualClock
from engine.sim.cost import Shape, chunk_costs
from engine.sim.devices import GPUS, Device, gpu_device
from engine.sim.disk import SimDisk, VirtualRead
from engine.sim.runtime import SimPool, SimRunner
from engine.types import EngineConfig

KV_BYTES = {"auto": None, "fp8": 1, "int8": 1}


class Simulation(Backend):
    """The model's shape, the device's cost model and the virtual clock of one engine.
    `build`: the real engine class, which a `cpu` device is calibrated with (once per
    machine)."""

    keeps_disk = False  # a simulation's disk tier holds no file

    def __init__(self, config: EngineConfig, build: Build) -> None:
        super().__init__(config)
        name = config.device.removeprefix(PREFIX)
        self.args = self.pool_args = model_args(config.model, config.cache_dir)
        dtype = config.dtype or ("float32" if name == "cpu" else "bfloat16")
        self.dtype = DTYPES[dtype]
        self.shape = Shape.of(self.args, dtype, KV_BYTES[config.kv_dtype])
        if name in GPUS:
            self.simulated: Device = gpu_device(name, self.shape)
        elif name == "cpu":
            self.simulated = cpu_device(config, build)
        else:
            raise ValueError(f"unknown simulated device {config.device!r}")
        self.gpu = name in GPUS  # the engine's GPU defaults apply (prefetch shares)
        self.device = torch.device("cpu")  # where the few tensors the engine makes live
        self.clock = VirtualClock()
        self.now = self.clock

    def default_tiers(self, gpu: int | None) -> tuple[int, int]:
        """The device's memory less the weights (and a tenth for activations); the CPU tier
        four times that."""
        bytes_per_block, s = self.bytes_per_block, self.shape
        weights = s.weight_bytes * (s.layers * s.layer_params + 2 * s.head_params)
        if math.isinf(self.simulated.memory_bytes):  # the CPU: as the real engine sizes it
            own = max(64, (1 << 30) // bytes_per_block)
        else:
            own = int(self.simulated.memory_bytes * 0.9 - weights) // bytes_per_block
        return own if gpu is None else gpu, 4 * own

    def pool(self, gpu_blocks: int, cpu_blocks: int, layout: KVLayout) -> SimPool:
        return SimPool(self.simulated, self.clock, self.bytes_per_block, cpu_blocks, layout)

    def runner(self, pool: SimPool) -> SimRunner:
        return SimRunner(self.simulated, pool)

    def policy_cost(self, max_context: int) -> CostModel:
        if self.simulated.policy_cost is not None:  # measured as the real engine measures it
            return self.simulated.policy_cost
        c = self.config
        return chunk_costs(self.simulated.cost, c.chunk_size, max_context, c.max_batch_tokens)

    def disk(self, cost: CostModel, bytes_per_chunk: int) -> DiskIndex:
        """The disk tier: no files, its time from the device's drive."""
        drive = self.simulated.disk
        if drive is None:
            raise ValueError(f"the simulated {self.simulated.name} has no disk tier")
        c = self.config
        size = int(c.disk_cache_gb * 1e9)
        return SimDisk(drive, self.clock, size, bytes_per_chunk, cost, c.chunk_size)

    def guides(self) -> None:
        return None

    def read_later(self, disk: DiskIndex | None, fn: Callable[..., Any], *args: Any) -> VirtualRead:
        """A read off the step loop (`fn(*args)`, the engine's read back) done now, its
        result ready once the disk tier has read what it asked for, or at once if nothing."""
        reads = disk.reads if disk is not None else 0
        try:
            value, error = fn(*args), None
        except Exception as e:  # the engine reports it as a failed read
            value, error = None, e
        due = disk.read_until if disk is not None and disk.reads > reads else self.clock()
        return VirtualRead(self.clock, due, value, error)

    def next_read_s(self, reads: list) -> float | None:
        now = self.clock()
        return min((f.due for f in reads if f.due > now), default=None)

    def wait_for_reads(self, reads: list, timeout: float) -> None:
        """Move the virtual clock to the end of the first read still running."""
        due = self.next_read_s(reads)
        if due is not None:
            self.clock.advance_to(due)
