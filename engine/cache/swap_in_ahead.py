"""The cache's side of a prefetch: an idle conversation's CPU chunks back to the GPU ahead
of its turn (the scheduling side is `engine/prefetch.py`).

A user is typing in an idle conversation, so its CPU chunks are copied back to GPU blocks
that are free, or taken from idle chunks worth less (reclaimed at no cost where they have
a CPU copy), from the back of its CPU run (the chunk next to its GPU run) first. They keep
their CPU copies: if the user never sends, they are reclaimed for free once they are worth
less than others (their value falls with idle time like any other chunk's). The next
admission counts the tokens prefetch brought back that are still on the GPU.
"""

from __future__ import annotations

from engine.cache.chunks import Chunk, ChunkTable
from engine.cache.eviction import Evictor, chunk_tokens
from engine.cache.order import UNEXPECTED, Candidate, EvictionOrder
from engine.cache.tiers import Tiers
from engine.copies import CopyPlan
from engine.snapshot import EngineCounters
from engine.types import CacheMode


class PrefetchSwapIn:
    def __init__(
        self,
        mode: str,
        chunk_size: int,
        tiers: Tiers,
        order: EvictionOrder,
        evictor: Evictor,
        counters: EngineCounters,
    ) -> None:
        self.mode, self.chunk_size = mode, chunk_size
        self.tiers, self.order, self.evictor, self.counters = tiers, order, evictor, counters

    def room_for(self, need: int) -> bool:
        """`need` GPU blocks are free or held by idle chunks of conversations nobody is
        typing in: a prefetch is a guess, so it never undoes another one, nor the context
        that an expected turn will look for."""
        spare = self.tiers.gpu.num_free
        for x in self.order.candidates():
            if spare >= need:
                break
            if not self.order.expected(x):
                spare += _idle_gpu_blocks(x)
        return spare >= need

    def on_cpu(self, t: ChunkTable) -> bool:
        """The idle table holds chunks on the CPU tier only (none missing): a swap-in
        prefetch can bring them back."""
        if t.pinned or t.missing or self.mode != CacheMode.PENSIEVE:
            return False
        return t.n_off_gpu > t.n_shared or any(c.gpu is None for c in t.shared_run())

    def prefetch(self, t: ChunkTable) -> tuple[CopyPlan, bool]:
        """Copy the idle table's CPU chunks back to the GPU, back of the CPU run first, into
        free blocks or blocks reclaimed at no cost from idle chunks worth less. Returns the
        swap-ins and whether nothing is left to bring back.

        Its turn must be expected (`Policy.expect`): making room then takes none of its own
        chunks (an unexpected table's CPU copies could be dropped, or its shared run let go,
        to make room for its own swap-ins)."""
        copies = CopyPlan()
        if not self.order.expected(t):
            raise ValueError(f"prefetch of {t.id!r} whose turn is not expected (Policy.expect)")
        if not self.on_cpu(t):
            return copies, True
        for i in range(t.n_off_gpu - 1, t.n_dropped - 1, -1):
            c = t.chunks[i]
            if c.gpu is not None:  # a shared chunk already on the GPU
                continue
            owner = c if c.shared else t
            need = len(c.cpu_pages())
            if not self._reclaim_for(t, self.order.key(owner, i), copies, need):
                return copies, False
            self.tiers.set_gpu(None if c.shared else t, c, c.cpu_win is not None)
            c.prefetched = True
            copies.swap_in += zip(c.cpu_pages(), c.gpu_pages(), strict=True)
            self.counters.prefetched_tokens += chunk_tokens(t, i, self.chunk_size)
            if i >= t.n_shared:  # the CPU run ends one chunk earlier: the layout holds
                t.n_off_gpu = i
            self.order.changed(c if c.shared else t)
        return copies, True

    def _reclaim_for(self, t: ChunkTable, key, copies: CopyPlan, need: int = 1) -> bool:
        """`need` free GPU pages for a prefetch of `t`: free already, or those of the
        lowest-value idle chunks if worth less than `key` (reclaimed at no cost when they
        have a CPU copy, else evicted as an admission would). Never a running turn's block
        (pinned chunks are no candidates), nor one of another expected conversation."""
        while self.tiers.gpu.num_free < need:
            found = self.order.pop_gpu()
            if found is None:
                return False
            x, i = found
            if x is t or self.order.expected(x) or self.order.key(x, i) >= key:
                return False
            self.evictor.evict_gpu(x, copies, UNEXPECTED)
        return True


def _idle_gpu_blocks(x: Candidate) -> int:
    if isinstance(x, Chunk):
        return int(x.gpu is not None and x.pins == 0)
    return 0 if x.pinned else x.n_gpu
