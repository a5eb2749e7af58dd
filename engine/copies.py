"""`CopyPlan`: the block copies between the tiers that a step needs, as the cache's
bookkeeping decides them and the KV pool carries them out. A plain value, so that the
runtime (pool, runner, graphs, tensor-parallel ranks) needs nothing of the bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CopyPlan:
    """Copies for a step, carried out in this order:
    swap_out (gpu -> cpu) before the freed GPU blocks are written again, then load (chunks
    read from the disk tier, host tensors -> gpu), then swap_in (cpu -> gpu, pipelined layer
    by layer with the forward); background (gpu -> cpu, ahead of time) after the forward; the
    GPU blocks stay in use until reclaimed."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    background: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    load: list[tuple[list, int]] = field(default_factory=list)  # (a chunk's tensors, gpu)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.background or self.load)

    def extend(self, other: CopyPlan) -> None:
        self.swap_out += other.swap_out
        self.swap_in += other.swap_in
        self.background += other.background
        self.load += other.load
