"""Chunks from the KV pool to the disk tier: those the cache drops (spills, each step) and
the full chunks of idle conversations (write-back, while idle and at a stop). The files are
keyed by each conversation's chunk hash chain (`StreamState.hashes`)."""

from __future__ import annotations

from engine.cache.manager import KVCacheManager
from engine.disk.index import DiskIndex
from engine.stream import StreamState


class DiskWrites:
    def __init__(self, disk: DiskIndex, pool, cache: KVCacheManager) -> None:
        self.disk = disk
        self.pool = pool
        self.cache = cache

    def spill(self, streams: dict[str, StreamState]) -> None:
        """Chunks the cache dropped in this step's planning: copied out of their blocks
        before this step's copies and forward reuse them, written by the disk tier's
        thread."""
        for cid, i, tier, pages in self.cache.take_spills():
            state = streams.get(cid)
            if state is None or i >= len(state.hashes) or not self.disk.writable:
                continue
            if state.hashes[i] in self.disk.index:
                continue
            self.disk.put(state.hashes[i], i, self.pool.read_pages(tier, pages))

    def write_back(
        self, streams: dict[str, StreamState], limit: int | None, only: str | None = None
    ) -> int:
        """Queue the full chunks held in memory that the disk tier lacks, of idle
        conversations (`only`: of that one): all of them, waiting for room in the writer's
        queue, or at most `limit` without waiting. Returns the chunks queued."""
        n, held = 0, self.disk.keys()
        tables = self.cache.held() if only is None else [self.cache.find(only)]
        for t in tables:
            if t is None:
                continue
            state = streams.get(t.id)
            if state is None or t.pinned:
                continue
            for j, c in enumerate(t.chunks[: len(state.hashes)]):
                tier = "gpu" if c.gpu is not None else "cpu" if c.cpu is not None else None
                if tier is None or state.hashes[j] in held:
                    continue
                if limit is not None and n >= limit:
                    return n
                pages = c.gpu_pages() if tier == "gpu" else c.cpu_pages()
                parts = self.pool.read_pages(tier, pages)
                if not self.disk.put(state.hashes[j], j, parts, wait=limit is None):
                    return n  # the writer is behind: later
                held.add(state.hashes[j])
                n += 1
        return n
