"""What an engine on `sim:<device>` is built from in place of the model and its tensors."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from engine.cache.policy import CostModel
from engine.model.loader import model_args
from engine.sim import PREFIX
from engine.sim.clock import VirtualClock
from engine.sim.cost import Shape, chunk_costs
from engine.sim.devices import GPUS, Device, gpu_device
from engine.sim.disk import SimDisk, VirtualRead
from engine.sim.runtime import SimPool, SimRunner
from engine.types import EngineConfig

KV_BYTES = {"auto": None, "fp8": 1, "int8": 1}


class Simulated:
    """The model's shape, the device's cost model and the virtual clock of one engine."""

    def __init__(self, config: EngineConfig) -> None:
        name = config.device.removeprefix(PREFIX)
        self.args = model_args(config.model, config.cache_dir)
        self.dtype = config.dtype or ("float32" if name == "cpu" else "bfloat16")
        self.shape = Shape.of(self.args, self.dtype, KV_BYTES[config.kv_dtype])
        if name in GPUS:
            self.device: Device = gpu_device(name, self.shape)
        elif name == "cpu":
            from engine.sim.calibrate import cpu_device

            self.device = cpu_device(config)
        else:
            raise ValueError(f"unknown simulated device {config.device!r}")
        self.gpu = name in GPUS  # the engine's GPU defaults apply (prefetch shares)
        self.clock = VirtualClock()

    def pool_sizes(self, bytes_per_block: int) -> tuple[int, int]:
        """Tiers when the config leaves them out: the device's memory less the weights (and
        a tenth for activations); the CPU tier four times that."""
        weights = self.shape.weight_bytes * (
            self.shape.layers * self.shape.layer_params + 2 * self.shape.head_params
        )
        if math.isinf(self.device.memory_bytes):  # the CPU: as the real engine sizes it
            return max(64, (1 << 30) // bytes_per_block), 4 * max(64, (1 << 30) // bytes_per_block)
        gpu = int(self.device.memory_bytes * 0.9 - weights) // bytes_per_block
        return gpu, 4 * gpu

    def policy_cost(self, chunk_size: int, batch_tokens: int) -> CostModel:
        if self.device.policy_cost is not None:  # measured as the real engine measures it
            return self.device.policy_cost
        return chunk_costs(self.device.cost, chunk_size, self.args.max_context, batch_tokens)

    def pool(self, bytes_per_block: int, cpu_blocks: int) -> SimPool:
        return SimPool(self.device, self.clock, bytes_per_block, cpu_blocks)

    def runner(self, pool: SimPool) -> SimRunner:
        return SimRunner(self.device, pool)

    def disk(
        self, capacity_bytes: int, chunk_bytes: int, cost: CostModel, chunk_size: int
    ) -> SimDisk:
        """The disk tier: no files, its time from the device's drive."""
        if self.device.disk is None:
            raise ValueError(f"the simulated {self.device.name} has no disk tier")
        return SimDisk(self.device.disk, self.clock, capacity_bytes, chunk_bytes, cost, chunk_size)

    def read_later(self, disk: SimDisk | None, fn: Callable[..., Any], *args: Any) -> VirtualRead:
        """A read off the step loop (`fn(*args)`, the engine's read back) done now, its
        result ready once the disk tier has read what it asked for, or at once if nothing."""
        reads = disk.reads if disk is not None else 0
        try:
            value, error = fn(*args), None
        except Exception as e:  # the engine reports it as a failed read
            value, error = None, e
        due = disk.read_until if disk is not None and disk.reads > reads else self.clock()
        return VirtualRead(self.clock, due, value, error)
