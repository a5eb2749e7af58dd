"""`DiskTier`: the disk tier as the engine holds it, one handle over its parts.

The cache decides what the tier gets: a full chunk that loses its last copy in memory is
queued by the cache (`KVCacheManager.take_spills`), and a chunk's value is capped by what
reading it back costs (`restore_s`). The tier does the I/O the cache never does: it copies
those chunks out of the pool and hands them to its store, whose own writer thread writes
them (`DiskWrites`, writes.py), and it reads a turn's dropped chunks back off the step loop
(`load`). The store is the bookkeeping of index.py under files (`ChunkFiles`, files.py) or
a simulated drive (`engine/sim/disk.py`); the keeps are journaled by the files (keeps.py).
"""

from __future__ import annotations

from engine.cache.manager import KVCacheManager
from engine.cache.sharing import chain_hashes
from engine.disk.index import DiskIndex, Loaded
from engine.disk.writes import DiskWrites
from engine.snapshot import PoolUsage
from engine.stream import StreamState


class DiskTier:
    # Slots: a setting meant for the store (`choice`, `read_limit_bps`) set here would be lost
    __slots__ = ("store", "pool", "chunk_size", "writes")

    def __init__(self, store: DiskIndex, pool, cache: KVCacheManager) -> None:
        self.store = store  # the chunks: files, or a simulated drive
        self.pool = pool
        self.chunk_size = cache.chunk_size
        self.writes = DiskWrites(store, pool, cache)
        cache.spill_to(self.restore_s)  # from now on the cache queues what it drops

    @property
    def writable(self) -> bool:
        """False once the disk refused a write (full or read-only): nothing more is written."""
        return self.store.writable

    def restore_s(self) -> float | None:
        """Seconds to read a chunk back from the disk tier (None: it is not writing)."""
        if not self.store.writable:
            return None
        return self.store.read_s(self.pool.bytes_per_chunk) or None

    # ---- writes (under the engine's lock) ----------------------------------------------------

    def spill(self, streams: dict[str, StreamState]) -> None:
        """After planning a step: the chunks the cache dropped in it, copied out of their
        blocks before the step's copies reuse them, and queued to be written."""
        self.writes.spill(streams)

    def write_back(
        self, streams: dict[str, StreamState], limit: int | None, only: str | None = None
    ) -> int:
        """Queue the full chunks of idle conversations held in memory that the tier lacks
        (`DiskWrites.write_back`); the chunks queued."""
        return self.writes.write_back(streams, limit, only)

    def keep(self, state: StreamState, seconds: float) -> None:
        """Keep a conversation's full chunks over any other for `seconds` (durably, where
        the tier is files), and write those it lacks behind the turn."""
        hashes = list(state.hashes)
        self.store.keep(hashes, self.store.now() + seconds)
        self.writes.write_back({state.id: state}, limit=len(hashes), only=state.id)

    def erase(self, hashes: list[bytes]) -> None:
        """Remove a deleted conversation's chunks (hash chain `hashes`), and their keeps."""
        for j, key in enumerate(hashes):
            self.store.remove(key, j)

    def seed(self, key: bytes, index: int, parts: list, size: int) -> None:
        """Hold a chunk at once, as if written long ago (`Engine.seed`)."""
        self.store.seed(key, index, parts, size)

    # ---- reads (off the step loop) -----------------------------------------------------------

    def load(self, prefix: list[int], dropped: int, base: int) -> Loaded | None:
        """What is worth reading back of a turn's dropped run of `dropped` chunks, given its
        history `prefix` of `base` tokens (`DiskIndex.load`); None: all of it is recomputed."""
        cs = self.chunk_size
        keys = chain_hashes(prefix[: dropped * cs], cs)
        whole = dropped * cs >= base  # nothing after the dropped run is held
        return self.store.load(keys, dropped, self.pool.bytes_per_chunk, whole)

    # ---- inspection and life -----------------------------------------------------------------

    def keys(self) -> set[bytes]:
        """The chunks this process knows the tier holds (a snapshot's "disk" chunks)."""
        return self.store.keys()

    def usage(self) -> PoolUsage:
        """The disk tier in chunks: capacity, used, free."""
        chunk = max(1, self.pool.bytes_per_chunk)
        total = self.store.capacity // chunk
        used = min(total, self.store.bytes // chunk)
        return PoolUsage(total, used, total - used)

    def stats(self) -> dict:
        """Files, bytes, writes, reads, dropped writes, evictions."""
        return self.store.stats()

    def flush(self) -> None:
        """Wait until every queued chunk is written."""
        self.store.flush()

    def clear(self) -> None:
        """Forget every chunk (benchmarks: runs must not find each other's chunks)."""
        self.store.clear()

    def close(self) -> None:
        """Write what is queued and stop writing."""
        self.store.close()
