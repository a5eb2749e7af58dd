"""Tier accounting: the GPU and CPU block pools, every chunk's blocks, and the counts
admission and ahead-of-time swap-out ask for.

Every change of a chunk's blocks or of a pin goes through `Tiers`, which keeps the counts
(pinned and reclaimable GPU blocks) up to date as chunks move, so asking is O(1).

A block is a page (engine/kv_layout.py): with one group, a chunk's every layer; with
sliding groups, a chunk inside the window holds `groups` pages on its tier (`gpu_win`,
`cpu_win`: the sliding groups'), one outside it. The counts are in pages.
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
        groups: int = 1,
    ) -> None:
        self.counters = EngineCounters() if counters is None else counters  # the ahead_* fates
        self.groups = groups  # pages a chunk inside the window holds on its tier
        self.sliding = {"gpu": 0, "cpu": 0}  # pages of the sliding groups in use per tier
        self.gpu = BlockPool(gpu_blocks)
        self.cpu = BlockPool(cpu_blocks)
        self.order = order  # told when a chunk is unpinned: a candidate again
        self.pinned_gpu = 0  # GPU blocks of pinned tables and of shared chunks they hold
        self.reclaimable = 0  # GPU blocks of idle chunks that have a CPU copy
        self.stale: list[int] = []  # CPU blocks to free once this step's swap-in has read them
        # The conversations whose chunks changed since the KV events last looked (None: off)
        self.touched: set[str] | None = None

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
        self._count(None, c, -1)
        c.pins += sign
        self._count(None, c, 1)
        if before and not c.pins:
            self.order.changed(c)  # a candidate again

    # ---- blocks: every change of a chunk goes through these, keeping the counts ------------

    def account(self, t: ChunkTable, c: Chunk, sign: int) -> None:
        """Add (1) or take away (-1) the chunk's blocks from the counts it belongs to."""
        self._count(t, c, sign)

    def touch(self, t: ChunkTable) -> None:
        """The table's chunks changed other than through their blocks (a shared chunk let
        go of, or linked): the KV events look at it again."""
        if self.touched is not None:
            self.touched.add(t.id)

    def _count(self, t: ChunkTable | None, c: Chunk, sign: int) -> None:
        """Add (1) or take away (-1) the chunk's GPU pages, as it is now, from its counts: a
        change of a chunk is taken away before and added after."""
        if self.touched is not None:
            if c.holders is not None:
                self.touched.update(h.id for h in c.holders)
            elif t is not None:
                self.touched.add(t.id)
        if c.gpu is None:
            return
        gpu = sign * (1 + len(c.gpu_win or ()))
        backed = gpu if c.cpu is not None else 0
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

    def pages(self, window: bool) -> int:
        """Pages a chunk holds on a tier: `groups` inside the window, 1 outside it."""
        return self.groups if window else 1

    def set_gpu(self, t: ChunkTable | None, c: Chunk, window: bool = False) -> None:
        """Give the chunk its GPU pages: its sliding groups' too where `window` (and there
        are any)."""
        if c.ahead:  # back on the GPU from the copy made ahead of time: it was needed
            self.counters.ahead_read_chunks += 1
            c.ahead = False
        self._count(t, c, -1)
        c.gpu = self.gpu.allocate()
        if window and self.groups > 1:
            c.gpu_win = tuple(self.gpu.allocate() for _ in range(self.groups - 1))
            self.sliding["gpu"] += self.groups - 1
        self._count(t, c, 1)

    def clear_gpu(self, t: ChunkTable | None, c: Chunk) -> None:
        if c.ahead and c.cpu is not None:  # reclaimed at no cost thanks to that copy
            self.counters.ahead_reclaimed_chunks += 1
        self._count(t, c, -1)
        for page in c.gpu_pages():
            self.gpu.release(page)
        self.sliding["gpu"] -= len(c.gpu_win or ())
        c.gpu = c.gpu_win = None
        c.prefetched = False

    def set_cpu(
        self, t: ChunkTable | None, c: Chunk, pages: tuple[int, ...], ahead: bool = False
    ) -> None:
        """`pages`: its CPU pages as its GPU pages are (or the one page of a chunk outside
        the window); `ahead`: a copy made ahead of time (counted, and its fate counted
        later)."""
        self._count(t, c, -1)
        c.cpu, c.cpu_win = pages[0], (pages[1:] or None)
        self.sliding["cpu"] += len(pages) - 1
        if ahead:
            c.ahead = True
            self.counters.ahead_chunks += 1
        self._count(t, c, 1)

    def clear_cpu(self, t: ChunkTable | None, c: Chunk, stale: bool = False) -> None:
        if c.ahead:
            if c.gpu is not None:  # given up before its GPU block was ever reclaimed
                self.counters.ahead_wasted_chunks += 1
            c.ahead = False
        self._count(t, c, -1)
        for page in c.cpu_pages():
            if stale:
                self.stale.append(page)
            else:
                self.cpu.release(page)
        self.sliding["cpu"] -= len(c.cpu_win or ())
        c.cpu = c.cpu_win = None
        self._count(t, c, 1)

    def window_gpu(self, t: ChunkTable, c: Chunk) -> None:
        """Give a GPU chunk its sliding groups' pages (a step computes it, or reads it
        inside its window). A CPU copy without them is given up."""
        if c.cpu is not None and c.cpu_win is None:
            self.clear_cpu(t, c, stale=True)
        self._count(t, c, -1)
        c.gpu_win = tuple(self.gpu.allocate() for _ in range(self.groups - 1))
        self.sliding["gpu"] += self.groups - 1
        self._count(t, c, 1)

    def unwindow(self, t: ChunkTable | None, c: Chunk) -> None:
        """The window has left the chunk: free its sliding groups' pages on both tiers (a
        step that read them was queued before: pages handed out again are written after)."""
        self._count(t, c, -1)
        for page in c.gpu_win or ():
            self.gpu.release(page)
        for page in c.cpu_win or ():
            self.stale.append(page)  # this step's swap-in may still read it
        self.sliding["gpu"] -= len(c.gpu_win or ())
        self.sliding["cpu"] -= len(c.cpu_win or ())
        c.gpu_win = c.cpu_win = None
        self._count(t, c, 1)

    def clear(self, t: ChunkTable | None, c: Chunk) -> None:
        """Free both of the chunk's blocks (it is dropped). The CPU copy first: one made
        ahead of time and freed with its GPU block was never of use."""
        if c.cpu is not None:
            self.clear_cpu(t, c)
        if c.gpu is not None:
            self.clear_gpu(t, c)

    def layer_pages(self, tier: str) -> tuple[int, int]:
        """A tier's pages in use: of the full layers (every chunk's; with one group, all of
        them) and of the sliding groups (engine/kv_layout.py)."""
        used = (self.gpu if tier == "gpu" else self.cpu).num_used
        if tier == "cpu":
            used -= len(self.stale)  # freed, handed out again next step
        return used - self.sliding[tier], self.sliding[tier]

    # ---- invariants ------------------------------------------------------------------------

    def check(self, tables: Iterable[ChunkTable], shared: Iterable[Chunk]) -> None:
        """Assert one owner per block, nothing leaked, and the counts right."""
        owners: dict[tuple[str, int], str] = {}
        sliding = {"gpu": 0, "cpu": 0}

        def own(c: Chunk, who: str) -> None:
            sliding["gpu"] += len(c.gpu_win or ())
            sliding["cpu"] += len(c.cpu_win or ())
            for tier, pages, pool in (
                ("gpu", c.gpu_pages(), self.gpu),
                ("cpu", c.cpu_pages(), self.cpu),
            ):
                assert len(pages) in (0, 1, self.groups), (who, tier, "pages", pages)
                for b in pages:
                    assert (tier, b) not in owners, f"{tier} block {b} owned twice"
                    assert not pool.is_free(b), f"{tier} block {b} is owned and free"
                    owners[(tier, b)] = who

        pinned_gpu = reclaimable = 0
        for t in tables:
            for i, c in enumerate(t.chunks):
                if not t.n_dropped <= i < t.n_shared:
                    own(c, t.id)
            gpu = t.chunks[t.n_off_gpu :]
            n_gpu = sum(len(c.gpu_pages()) for c in gpu)
            n_backed = sum(len(c.gpu_pages()) for c in gpu if c.cpu is not None)
            assert (t.n_gpu, t.n_backed) == (n_gpu, n_backed), (t.id, "counts drifted")
            pinned_gpu += n_gpu if t.pinned else 0
            reclaimable += 0 if t.pinned else n_backed
        for c in shared:
            own(c, "shared")
            if c.gpu is not None:
                pinned_gpu += len(c.gpu_pages()) if c.pins else 0
                reclaimable += len(c.gpu_pages()) if not c.pins and c.cpu is not None else 0
        assert (self.pinned_gpu, self.reclaimable) == (pinned_gpu, reclaimable), "counts"
        assert self.sliding == sliding, ("sliding pages miscounted", self.sliding, sliding)
        for tier, pool in (("gpu", self.gpu), ("cpu", self.cpu)):
            owned = sum(1 for t, _ in owners if t == tier)
            stale = len(self.stale) if tier == "cpu" else 0
            assert owned + pool.num_free + stale == pool.num_blocks, f"{tier} blocks leaked"
