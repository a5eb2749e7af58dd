"""The cache's side of the disk tier: the chunks that lose their last copy in memory (spills),
queued for the disk tier to copy out and write (`take`; `engine/disk/`)."""

from __future__ import annotations

from engine.cache.chunks import Chunk, ChunkTable
from engine.snapshot import EngineCounters

Spill = tuple[str, int, str, tuple[int, ...]]  # (conversation, chunk index, tier, its pages)


class Spills:
    def __init__(self, chunk_size: int, counters: EngineCounters) -> None:
        self.chunk_size = chunk_size
        self.counters = counters
        self.spilling = False  # a disk tier takes dropped chunks
        self.queue: list[Spill] = []
        self._incoming: dict[int, int] = {}  # CPU page -> the GPU page this step swaps out to it

    def begin_step(self) -> None:
        self._incoming = {}

    def swapping_out(self, cpu_block: int, gpu_block: int) -> None:
        """This step copies `gpu_block` to `cpu_block`: until then the GPU block holds it."""
        self._incoming[cpu_block] = gpu_block

    def spill(self, t: ChunkTable, i: int, c: Chunk) -> None:
        """Chunk `c` (at index `i` of `t`) loses its last copy in memory: with a disk tier,
        the engine copies it out of its block before the block is used again and queues it
        to be written (`take`). Only full chunks: a file is keyed by its tokens."""
        if not self.spilling or (i + 1) * self.chunk_size > t.tokens:
            return
        if c.gpu is not None:
            self.queue.append((t.id, i, "gpu", c.gpu_pages()))
        elif c.cpu in self._incoming:  # its swap-out has not run yet: the GPU pages hold it
            self.queue.append((t.id, i, "gpu", tuple(self._incoming[p] for p in c.cpu_pages())))
        elif c.cpu is not None:
            self.queue.append((t.id, i, "cpu", c.cpu_pages()))
        else:
            return
        self.counters.spilled_tokens += self.chunk_size

    def take(self) -> list[Spill]:
        """(conversation, chunk index, tier, pages) of every chunk dropped since the last
        call, whose pages still hold its KV until this step's copies run."""
        out, self.queue = self.queue, []
        return out
