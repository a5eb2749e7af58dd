"""Eviction: freeing blocks in the eviction order. Room on the GPU (reclaim a chunk's
block if it has a CPU copy, else swap it out, else drop it), CPU blocks (dropping the
lowest-value CPU chunks), and the ahead-of-time swap-out."""

from __future__ import annotations

import math

from engine.cache.chunks import Chunk, ChunkTable
from engine.cache.order import Candidate, EvictionOrder
from engine.cache.sharing import Sharing
from engine.cache.tiers import Tiers
from engine.cache.to_disk import Spills
from engine.copies import CopyPlan
from engine.snapshot import EngineCounters

# Ahead-of-time swap-out keeps free (or free to reclaim) at most what this many of the
# busiest recent steps allocate, and at most the threshold's share of the GPU tier: a copy
# made long before its block is needed is more likely given up (its conversation comes back
# and writes it, or runs and pins it) than used.
AHEAD_STEPS = 8
PEAK_DECAY = 0.99  # per step: the busiest step of the last few hundred, roughly


def chunk_tokens(t: Candidate, i: int, chunk_size: int) -> int:
    """Positions chunk `i` of `t` holds (a shared chunk is full)."""
    if isinstance(t, Chunk):
        return chunk_size
    return max(0, min(chunk_size, t.tokens - i * chunk_size))


class Evictor:
    def __init__(
        self,
        chunk_size: int,
        swap_out_threshold: float,
        tiers: Tiers,
        order: EvictionOrder,
        sharing: Sharing,
        spills: Spills,
        counters: EngineCounters,
    ) -> None:
        self.chunk_size = chunk_size
        self.swap_out_threshold = swap_out_threshold
        self.tiers, self.order, self.sharing, self.spills = tiers, order, sharing, spills
        self.counters = counters
        self._allocated = tiers.gpu.allocations  # GPU blocks handed out up to the last step
        self.peak: float | None = None  # blocks the busiest recent step allocated (decaying)

    def make_room_gpu(self, n: int, copies: CopyPlan, cpu_below=None) -> bool:
        """Free GPU blocks until `n` are free; False if the candidates ran out."""
        if self.tiers.gpu.num_free >= n:
            return True
        refused: list[Candidate] = []  # pinned, with no CPU block to go to: passed over
        try:
            while self.tiers.gpu.num_free < n:
                found = self.order.pop_gpu()
                if found is None:
                    if self.order.refresh():  # older keys: a pin that expired since sorted
                        refused.clear()  # as pinned (the heaps are rebuilt, every one in)
                        continue
                    return False  # pinned chunks are all that is left, the CPU tier full
                if not self.evict_gpu(found[0], copies, cpu_below):
                    # another pinned conversation may still have chunks with a CPU copy
                    refused.append(found[0])
                    self.order.gpu.skip(found[0])
            return True
        finally:
            for x in refused:
                self.order.gpu.push(x)

    def evict_gpu(self, x: Candidate, copies: CopyPlan, cpu_below=None) -> bool:
        """Free the GPU block of a table's first GPU chunk, or of a shared chunk; False if
        it is pinned and could only be dropped (it stays)."""
        if isinstance(x, Chunk):
            return self._evict_shared_gpu(x, copies, cpu_below)
        return self.evict_front_gpu(x, copies, cpu_below)

    def _keeps(self, x: Candidate, i: int) -> bool:
        """A client pinned its conversation (a holder's): it must not be dropped."""
        return self.order.pinned(x)

    def evict_front_gpu(
        self, t: ChunkTable, copies: CopyPlan, cpu_below=None, force: bool = False
    ) -> bool:
        """Free the GPU block of the table's first GPU chunk: reclaim it if it has a CPU
        copy, else swap it out (into a CPU block of a chunk worth less than `cpu_below`, when
        given), else drop it (with the chunks before it). A pinned conversation's chunk is
        never dropped: False, nothing changed (`force`: a suspended turn's own chunks go
        where they can, dropped if the CPU tier is full of pinned ones)."""
        i = t.n_off_gpu
        chunk = t.chunks[i]
        keep = not force and self._keeps(t, i)
        if chunk.cpu is None and self.tiers.cpu.num_blocks:
            pages = self.alloc_cpu_pages(chunk, max_key=cpu_below)
            if pages is not None:
                self._swap_out(t, chunk, pages, copies)
                self.counters.swapped_out_tokens += chunk_tokens(t, i, self.chunk_size)
        if chunk.cpu is None and keep:
            return False
        if chunk.cpu is None:
            self.spills.spill(t, i, chunk)
        self.tiers.clear_gpu(t, chunk)
        t.n_off_gpu = i + 1
        if chunk.cpu is None:  # dropped: keep the layout by dropping what is before
            self.sharing.let_go(t, spill=True)
            for j in range(t.n_dropped, i + 1):
                self.counters.dropped_tokens += chunk_tokens(t, j, self.chunk_size)
                self.spills.spill(t, j, t.chunks[j])
                self.sharing.free_chunk(t, t.chunks[j])
            t.n_dropped = t.n_shared = i + 1
        else:
            self.order.cpu.push(t)  # a new CPU-only chunk: maybe its cheapest CPU block
        return True

    def _evict_shared_gpu(self, c: Chunk, copies: CopyPlan, cpu_below=None) -> bool:
        """Free a shared chunk's GPU block: reclaim, swap out, or drop it (never a pinned
        holder's: False)."""
        keep = self._keeps(c, 0)
        if c.cpu is None and self.tiers.cpu.num_blocks:
            pages = self.alloc_cpu_pages(c, max_key=cpu_below)
            if c not in self.sharing.shared or c.gpu is None:  # freed while the CPU made room
                for page in pages or ():
                    self.tiers.cpu.release(page)
                return True
            if pages is not None:
                self._swap_out(None, c, pages, copies)
                self.counters.swapped_out_tokens += self.chunk_size
        if c.cpu is None:
            if keep:
                return False
            self.sharing.drop(c)
            return True
        self.tiers.clear_gpu(None, c)
        self.order.cpu.push(c)
        return True

    def _swap_out(
        self, t: ChunkTable | None, c: Chunk, pages: tuple[int, ...], copies: CopyPlan
    ) -> None:
        """Copy the chunk's GPU pages to CPU pages `pages` in this step's swap-out."""
        pairs = list(zip(c.gpu_pages(), pages, strict=True))
        self.tiers.set_cpu(t, c, pages)
        copies.swap_out += pairs
        for gpu, cpu in pairs:
            self.spills.swapping_out(cpu, gpu)

    def alloc_cpu_pages(self, c: Chunk, max_key=None) -> tuple[int, ...] | None:
        """A CPU page for each of the chunk's GPU pages (`alloc_cpu`); None if not all of
        them can be had (none is kept then)."""
        pages: list[int] = []
        for _ in c.gpu_pages():
            page = self.alloc_cpu(max_key)
            if page is None:
                for p in pages:
                    self.tiers.cpu.release(p)
                return None
            pages.append(page)
        return tuple(pages)

    def alloc_cpu(self, max_key=None) -> int | None:
        """A CPU block, dropping the lowest-value CPU chunks if the pool is full (only those
        whose key is below `max_key`, when given)."""
        cpu = self.tiers.cpu
        if cpu.num_free:
            return cpu.allocate()
        found = self.order.pop_cpu()
        if found is None:
            return None
        t, i = found
        key = self.order.key(t, i)
        if max_key is not None and key >= max_key:
            return None
        if self._keeps(t, i):  # pinned chunks come last in the order: nothing else is left,
            return self.alloc_cpu(max_key) if self.order.refresh() else None  # or keys aged
        if isinstance(t, Chunk):
            if t.gpu is None:  # a CPU-only shared chunk: it is dropped
                self.sharing.drop(t)
            else:  # it loses its copy: it must be copied again before it is reclaimed
                self.tiers.clear_cpu(None, t)
                self.order.unbacked.push(t)
            return cpu.allocate()
        chunk = t.chunks[i]
        if i < t.n_off_gpu:  # a CPU-only chunk: it is dropped (with the shared run before it)
            self.sharing.let_go(t, spill=True)
            self.spills.spill(t, i, chunk)
            self.counters.dropped_tokens += chunk_tokens(t, i, self.chunk_size)
            t.n_dropped = t.n_shared = i + 1
        else:  # a GPU chunk loses its copy: it must be copied again before it is reclaimed
            self.order.unbacked.push(t)
        self.tiers.clear_cpu(t, chunk)
        return cpu.allocate()

    def swap_out_ahead(self, busy: bool = False) -> CopyPlan:
        """When free GPU blocks fall under the target, copy the lowest-value chunks to the
        CPU in the background, keeping their GPU blocks until they are reallocated. The
        target: the threshold's share of the GPU tier, or what `AHEAD_STEPS` of the busiest
        recent steps allocate if less (called once a step, it measures that too).
        Does nothing while a swap-in is in flight (`busy`): swap-in has priority."""
        copies = CopyPlan()
        gpu, cpu = self.tiers.gpu, self.tiers.cpu
        step, self._allocated = gpu.allocations - self._allocated, gpu.allocations
        self.peak = step if self.peak is None else max(step, self.peak * PEAK_DECAY)
        if busy or cpu.num_blocks == 0:
            return copies
        want = min(
            int(self.swap_out_threshold * gpu.num_blocks), math.ceil(AHEAD_STEPS * self.peak)
        )
        short = want - gpu.num_free - self.tiers.reclaimable
        if short <= 0:
            return copies
        while len(copies.background) < short:
            found = self.order.pop_unbacked()
            if found is None:
                break
            t, i = found
            chunk = t if isinstance(t, Chunk) else t.chunks[i]
            pages = self.alloc_cpu_pages(chunk, max_key=self.order.key(t, i))
            if pages is None:
                break
            if chunk.gpu is None or chunk.cpu is not None:  # let go while making room
                for page in pages:
                    cpu.release(page)
                continue
            copies.background += zip(chunk.gpu_pages(), pages, strict=True)
            self.tiers.set_cpu(t, chunk, pages, ahead=True)  # type: ignore[arg-type]
            self.order.cpu.push(t)  # the copy may now be its cheapest CPU block
            self.counters.swapped_out_tokens += chunk_tokens(t, i, self.chunk_size)
        return copies
