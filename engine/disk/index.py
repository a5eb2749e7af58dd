"""The disk tier's bookkeeping, with no file and no tensor: the chunks it holds by key and
their bytes against its capacity, which go first when it is over (the retention value of the
policy: recompute cost of the chunk over its idle time, the chunks a client asked to keep
last), and which chunks of a dropped run are worth reading back (`load`).

`ChunkFiles` (files.py) keeps the chunks in files; a simulated device's tier
(`engine/sim/disk.py`) only counts them and the time their bytes take.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

QUEUE = 256  # chunks waiting to be written; more are dropped, never waited for
FREE_TO = 0.95  # an eviction round frees files down to this share of the capacity


@dataclass
class Loaded:
    """Chunks [first, last) of a conversation's dropped run of `dropped` chunks, read back
    from the disk tier for its turn; the chunks before `first` are recomputed, and so are
    those from `last` on (a partly filled last chunk has no file) with the turn's own
    tokens. Valid while the conversation still has `dropped` dropped chunks."""

    first: int
    last: int
    dropped: int
    parts: dict[int, list[torch.Tensor]]

    def pages(self, i: int) -> int | None:
        """Pages chunk i's file holds (engine/kv_layout.py: every group's where it was
        inside its window); None for a simulated tier's, which holds no tensors."""
        parts = self.parts[i]
        if not parts:
            return None
        return parts[0].shape[2] if parts[0].dim() == 6 else 1


@dataclass
class Entry:
    size: int
    index: int  # the chunk's position in its conversation (its recompute cost grows with it)
    used: float  # last written or read


class DiskIndex:
    """The chunks the tier holds, by key, against its capacity; a subclass stores them
    (`read`, `put`): in files (`ChunkFiles`), or as sizes in virtual time (`SimDisk`)."""

    def __init__(
        self,
        capacity_bytes: int,
        cost: Callable[[int], float] | None = None,
        chunk_size: int = 32,
        now: Callable[[], float] = time.time,
    ) -> None:
        self.capacity = capacity_bytes
        self.cost = cost or (lambda context: float(context))
        self.chunk_size = chunk_size
        self.now = now  # the time of last use (wall time: files outlive the process)
        self.lock = threading.Lock()  # the index and the byte count
        self.index: dict[bytes, Entry] = {}
        # Chunks a client asked to keep (`prompt_cache_retention`), until when: they go only
        # once every other file has (a tier full of kept chunks gives up the oldest kept)
        self.kept: dict[bytes, float] = {}
        self.pending: dict[bytes, list[torch.Tensor]] = {}  # queued, not written yet
        self.bytes = 0
        self.read_bps: float | None = None  # read bandwidth the cost rule uses
        self.writes = self.reads = self.failed = self.skipped = self.evicted = 0
        self.writable = True
        # How a dropped run comes back: "cost" (the cheaper of reading and recomputing, per
        # chunk), or always "load" / always "recompute" (benchmarks compare the three)
        self.choice = "cost"

    def keys(self) -> set[bytes]:
        """The chunks this process knows the tier holds (written or queued)."""
        with self.lock:
            return self.index.keys() | self.pending.keys()

    def has(self, key: bytes, index: int) -> bool:
        return key in self.pending or key in self.index

    def read(self, key: bytes, index: int) -> list[torch.Tensor] | None:
        """The chunk's tensors, None when it cannot be read (it is recomputed)."""
        raise NotImplementedError

    def put(self, key: bytes, index: int, parts: list[torch.Tensor], wait: bool = False) -> bool:
        """Queue a chunk to be written; False if it is not."""
        raise NotImplementedError

    def seed(self, key: bytes, index: int, parts: list[torch.Tensor], size: int) -> None:
        """Hold a chunk at once, as if written long ago (a seeded state, `Engine.seed`):
        indexed with `size` bytes, no write timed; a tier of files writes `parts` first."""
        self._add(key, index, size)

    def keep(self, keys: list[bytes], until: float) -> None:
        """Keep these chunks (once written) over any other until `until` (wall time)."""
        with self.lock:
            for key in keys:
                self.kept[key] = max(until, self.kept.get(key, 0.0))

    def remove(self, key: bytes, index: int) -> None:
        """Forget a chunk (a deleted conversation's), queued or written."""
        with self.lock:
            self.pending.pop(key, None)
            self.kept.pop(key, None)
        self._unindex(key)

    def clear(self) -> None:
        """Forget every chunk (benchmarks: runs that replay the same conversations must not
        find each other's chunks)."""
        with self.lock:
            self.index, self.bytes = {}, 0

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued chunk is written."""

    def close(self) -> None:
        """Write what is queued and stop writing."""

    def _add(self, key: bytes, index: int, size: int) -> None:
        """Index a chunk just written; over the capacity, evict."""
        with self.lock:
            old = self.index.get(key)
            self.bytes += size - (old.size if old else 0)
            self.index[key] = Entry(size, index, self.now())
            self.writes += 1
        if self.bytes > self.capacity:
            self._evict()

    def _evict(self) -> None:
        """Remove the chunks of lowest retention value until under FREE_TO of the capacity."""
        now = self.now()
        with self.lock:
            self.kept = {k: t for k, t in self.kept.items() if t > now}
            by_value = sorted(
                self.index.items(),
                key=lambda kv: (
                    kv[0] in self.kept,
                    self.cost((kv[1].index + 1) * self.chunk_size) / max(now - kv[1].used, 1e-3),
                ),
            )
            goal = self.capacity * FREE_TO
            gone = []
            for key, e in by_value:
                if self.bytes <= goal:
                    break
                self.bytes -= e.size
                gone.append((key, e))
                del self.index[key]
            self.evicted += len(gone)
        self._evicted(gone)

    def _evicted(self, gone: list[tuple[bytes, Entry]]) -> None:
        """What evicted chunks leave behind (files) goes too."""

    def _unindex(self, key: bytes) -> None:
        with self.lock:
            e = self.index.pop(key, None)
            if e is not None:
                self.bytes -= e.size

    def _used(self, key: bytes) -> None:
        """A chunk was read: it counts as recently used."""
        with self.lock:
            self.reads += 1
            e = self.index.get(key)
            if e is not None:
                e.used = self.now()

    def load(
        self, keys: list[bytes], dropped: int, chunk_bytes: int, whole: bool = False
    ) -> Loaded | None:
        """Read back what is worth reading of a dropped run of `dropped` chunks with hash
        chain `keys` (its full chunks'): a run of files without a gap that ends at the last
        full chunk, or, when the dropped run is the whole context (`whole`: nothing after it
        is held, as after a restart), the longest run of files anywhere (a crash leaves the
        leading chunks, dropped early, on disk and loses the rest). Each chunk of the run is
        read only if that is cheaper than recomputing it (recompute grows with the chunk's
        position, so the cheap ones are a prefix). None: all of it is recomputed."""
        if self.choice == "recompute":
            return None
        full = min(dropped, len(keys))
        present = [self.has(keys[j], j) for j in range(full)]
        first = last = full
        while first > 0 and present[first - 1]:
            first -= 1
        if whole:
            start = None
            for j in range(full + 1):
                if j < full and present[j]:
                    start = j if start is None else start
                elif start is not None:
                    if j - start > last - first:
                        first, last = start, j
                    start = None
        read = self.read_s(chunk_bytes) if self.choice == "cost" else 0.0
        while first < last and self.cost((first + 1) * self.chunk_size) < read:
            first += 1
        parts: dict[int, list[torch.Tensor]] = {}
        for j in range(first, last):
            got = self.read(keys[j], j)
            if got is None:  # damaged or gone: recompute up to it
                parts, first = {}, j + 1
                continue
            parts[j] = got
        return Loaded(first, last, dropped, parts) if parts else None

    def read_s(self, nbytes: int) -> float:
        """Expected seconds to read `nbytes` (0 until a read was timed)."""
        return nbytes / self.read_bps if self.read_bps else 0.0

    def stats(self) -> dict:
        return {
            "files": len(self.index),
            "bytes": self.bytes,
            "capacity_bytes": self.capacity,
            "writes": self.writes,
            "reads": self.reads,
            "failed_writes": self.failed,
            "skipped_writes": self.skipped,
            "evicted": self.evicted,
            "writable": self.writable,
            "read_mb_s": round(self.read_bps / 1e6, 1) if self.read_bps else None,
        }
