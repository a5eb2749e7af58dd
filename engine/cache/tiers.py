"""Tier accounting: the GPU and CPU block pools, every chunk's blocks, and the counts
admission and ahead-of-time swap-out ask for.

Every change of a chunk's blocks or of a pin goes through `Tiers`, which keeps the counts
(pinned and reclaimable GPU blocks) up to date as chunks move, so asking is O(1).
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.cache.blocks import BlockPool
from engine.cache.chunks import Chunk, ChunkTable
from engine.cache.order import EvictionOrder
from engine.snapshot import EngineCounters


class Tiers:
    def __init__(
        self,
        gpu_blocks: int,
        cpu_blocks: int,
        order: EvictionOrder,
        counters: EngineCounters | None = None,
    ) -> None:
        self.counters = EngineCounters() if counters is None else counters  # the ahead_* fates
        self.gpu = BlockPool(gpu_blocks)
        self.cpu = BlockPool(cpu_blocks)
        self.order = order  # told when a chunk is unpinned: a candidate again
        self.pinned_gpu = 0  # GPU blocks of pinned tables and of shared chunks they hold
        self.reclaimable = 0  # GPU blocks of idle chunks that have a CPU copy
        self.stale: list[int] = []  # CPU blocks to free once this step's swap-in has read them

    def begin_step(self) -> None:
        """The previous step's copies are queued: the CPU blocks whose copy went stale can
        be handed out again."""
        for block in self.stale:
            self.cpu.release(block)
        self.stale = []

    # ---- pins ------------------------------------------------------------------------------

    def set_pinned(self, t: ChunkTable, pinned: bool) -> None:
        if t.pinned == pinned:
            return
        sign = 1 if pinned else -1
        self.pinned_gpu += sign * t.n_gpu
        self.reclaimable -= sign * t.n_backed
        t.pinned = pinned
        t.gpu_ids = None  # read again from the chunks (`ChunkTable.gpu_blocks`)
        for c in t.shared_run():
            self.pin_shared(c, sign)
        if not pinned:
            self.order.changed(t)  # a candidate again

    def pin_shared(self, c: Chunk, sign: int) -> None:
        before = c.pins > 0
        c.pins += sign
        if before != (c.pins > 0) and c.gpu is not None:
            flip = 1 if c.pins else -1  # counted as pinned now, or no longer
            self.pinned_gpu += flip
            self.reclaimable -= flip * (c.cpu is not None)
        if before and not c.pins:
            self.order.changed(c)  # a candidate again

    # ---- blocks: every change of a chunk goes through these, keeping the counts ------------

    def account(self, t: ChunkTable, c: Chunk, sign: int) -> None:
        """Add (1) or take away (-1) the chunk's blocks from the counts it belongs to."""
        if c.gpu is not None:
            self._count(t, c, sign, sign * (c.cpu is not None))

    def _count(self, t: ChunkTable | None, c: Chunk, gpu: int, backed: int) -> None:
        if c.shared:  # counted once, whoever holds it
            pinned = c.pins > 0
        else:
            assert t is not None
            t.n_gpu += gpu
            t.n_backed += backed
            pinned = t.pinned
        if pinned:
            self.pinned_gpu += gpu
        else:
            self.reclaimable += backed

    def set_gpu(self, t: ChunkTable | None, c: Chunk) -> None:
        if c.ahead:  # back on the GPU from the copy made ahead of time: it was needed
            self.counters.ahead_read_chunks += 1
            c.ahead = False
        c.gpu = self.gpu.allocate()
        self._count(t, c, 1, c.cpu is not None)

    def clear_gpu(self, t: ChunkTable | None, c: Chunk) -> None:
        if c.ahead and c.cpu is not None:  # reclaimed at no cost thanks to that copy
            self.counters.ahead_reclaimed_chunks += 1
        self.gpu.release(c.gpu)  # type: ignore[arg-type]
        c.gpu = None
        c.prefetched = False
        self._count(t, c, -1, -(c.cpu is not None))

    def set_cpu(self, t: ChunkTable | None, c: Chunk, block: int, ahead: bool = False) -> None:
        """`ahead`: a copy made ahead of time (counted, and its fate counted later)."""
        c.cpu = block
        if ahead:
            c.ahead = True
            self.counters.ahead_chunks += 1
        self._count(t, c, 0, c.gpu is not None)

    def clear_cpu(self, t: ChunkTable | None, c: Chunk, stale: bool = False) -> None:
        if c.ahead:
            if c.gpu is not None:  # given up before its GPU block was ever reclaimed
                self.counters.ahead_wasted_chunks += 1
            c.ahead = False
        if stale:
            self.stale.append(c.cpu)  # type: ignore[arg-type]
        else:
            self.cpu.release(c.cpu)  # type: ignore[arg-type]
        c.cpu = None
        self._count(t, c, 0, -(c.gpu is not None))

    def clear(self, t: ChunkTable | None, c: Chunk) -> None:
        """Free both of the chunk's blocks (it is dropped). The CPU copy first: one made
        ahead of time and freed with its GPU block was never of use."""
        if c.cpu is not None:
            self.clear_cpu(t, c)
        if c.gpu is not None:
            self.clear_gpu(t, c)

    # ---- invariants ------------------------------------------------------------------------

    def check(self, tables: Iterable[ChunkTable], shared: Iterable[Chunk]) -> None:
        """Assert one owner per block, nothing leaked, and the counts right."""
        owners: dict[tuple[str, int], str] = {}

        def own(c: Chunk, who: str) -> None:
            for tier, b, pool in (("gpu", c.gpu, self.gpu), ("cpu", c.cpu, self.cpu)):
                if b is None:
                    continue
                assert (tier, b) not in owners, f"{tier} block {b} owned twice"
                assert not pool.is_free(b), f"{tier} block {b} is owned and free"
                owners[(tier, b)] = who

        pinned_gpu = reclaimable = 0
        for t in tables:
            for i, c in enumerate(t.chunks):
                if not t.n_dropped <= i < t.n_shared:
                    own(c, t.id)
            n_gpu = len(t.chunks) - t.n_off_gpu
            n_backed = sum(1 for c in t.chunks[t.n_off_gpu :] if c.cpu is not None)
            assert (t.n_gpu, t.n_backed) == (n_gpu, n_backed), (t.id, "counts drifted")
            pinned_gpu += n_gpu if t.pinned else 0
            reclaimable += 0 if t.pinned else n_backed
        for c in shared:
            own(c, "shared")
            if c.gpu is not None:
                pinned_gpu += 1 if c.pins else 0
                reclaimable += 1 if not c.pins and c.cpu is not None else 0
        assert (self.pinned_gpu, self.reclaimable) == (pinned_gpu, reclaimable), "counts"
        for tier, pool in (("gpu", self.gpu), ("cpu", self.cpu)):
            owned = sum(1 for t, _ in owners if t == tier)
            stale = len(self.stale) if tier == "cpu" else 0
            assert owned + pool.num_free + stale == pool.num_blocks, f"{tier} blocks leaked"
