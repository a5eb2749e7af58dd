"""`CopyPlan`: the block copies between the tiers that a step needs, as the cache's
bookkeeping decides them and the KV pool carries them out. A plain value, so that the
runtime (pool, runner, graphs, tensor-parallel ranks) needs nothing of the bookkeeping.

Below it, the host-side bookkeeping of copies in flight on a copy stream, kept free of
tensors so the CPU tests check it: which pending swap-outs a forward must wait for
(`PendingReads`), and when a staging buffer may be rewritten (`StagingRing`)."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol


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
    # (a chunk's tensors, its GPU pages: engine/kv_layout.py)
    load: list[tuple[list, tuple[int, ...]]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.background or self.load)

    def extend(self, other: CopyPlan) -> None:
        self.swap_out += other.swap_out
        self.swap_in += other.swap_in
        self.background += other.background
        self.load += other.load


# ---- copies in flight: host bookkeeping, pure Python (tested on the CPU) -----------------


class Fence(Protocol):
    """What the bookkeeping needs of a CUDA event: has the work before it finished?"""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass
class PendingReads:
    """GPU blocks that swap-outs still in flight on the copy stream read, one batch per
    copy, each under the fence recorded after it. A forward that writes one of those
    blocks must wait for that fence first; one that writes none never waits (a background
    swap-out of blocks nobody reuses costs the forward nothing)."""

    batches: list[tuple[Fence, frozenset[int]]] = field(default_factory=list)

    def add(self, fence: Fence, blocks: Iterable[int]) -> None:
        blocks = frozenset(blocks)
        if blocks:
            self.batches.append((fence, blocks))

    def retire(self) -> None:
        """Forget the batches whose copy is done (a query, never a wait)."""
        self.batches = [(f, b) for f, b in self.batches if not f.query()]

    def blocking(self, writes: Collection[int] | None) -> list[Fence]:
        """The fences a forward writing GPU blocks `writes` must wait for (None: unknown,
        so every batch in flight)."""
        if writes is None:
            return [f for f, _ in self.batches]
        return [f for f, b in self.batches if not b.isdisjoint(writes)]


def written_blocks(
    tables: list[list[int]], starts: list[int], ends: list[int], chunk_size: int
) -> set[int]:
    """GPU blocks a forward writes KV into: piece i writes positions [starts[i], ends[i])
    through its block table tables[i]."""
    out: set[int] = set()
    for table, start, end in zip(tables, starts, ends, strict=True):
        out.update(table[start // chunk_size : -(-end // chunk_size)])
    return out


@dataclass
class RingSlot:
    """One staging buffer (the caller's tensors, or anything) and the fence after the last
    copy that read it."""

    buffer: Any = None
    capacity: int = 0
    fence: Fence | None = None


@dataclass
class StagingRing:
    """Staging buffers used round robin. A page-locked buffer uploaded asynchronously must
    not be rewritten until that upload ran: `take` hands out the next slot, waiting only
    when its last copy is still in flight (the ring went round faster than the device),
    and says when the slot must grow; the caller fills it and sets its fence."""

    slots: list[RingSlot]
    next: int = 0
    waits: int = 0  # times the host had to wait for a slot (a sign the ring is too small)

    @classmethod
    def of(cls, n: int) -> StagingRing:
        return cls([RingSlot() for _ in range(n)])

    def take(self, need: int) -> tuple[RingSlot, int | None]:
        """The next slot, free to rewrite, and the capacity to grow it to (None: it fits)."""
        slot = self.slots[self.next]
        self.next = (self.next + 1) % len(self.slots)
        if slot.fence is not None:
            if not slot.fence.query():
                self.waits += 1
                slot.fence.synchronize()
            slot.fence = None
        grow = None if need <= slot.capacity else max(need, 2 * slot.capacity, 64)
        return slot, grow
