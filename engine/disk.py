"""The disk tier: KV chunks in files that outlive the process, keyed by what they hold.

A chunk's file is named by the hash chain of the tokens from the start of the conversation
through the chunk (`chain_hashes`), under a directory named by the model, its dtype, the KV
dtype and the chunk size: a file is valid for exactly the contexts that produced it, an
edit invalidates by hash, and chunks two conversations share are stored once. Several
processes may share the directory (replicas on shared storage): a lookup looks at the
files, not at this process's index.

Writes never block the step loop: `put` queues the chunk (its blocks already copied out of
the pool) for a writer thread, which writes a temporary file and renames it; a full queue
or a failing disk drops the write (the chunk is then recomputed when needed, as without a
disk tier). Each file carries a checksum; a read that finds a missing, truncated or
corrupted file returns None and removes it. When the tier is over `capacity_bytes`, files
go by the retention value of the policy: recompute cost of the chunk over its idle time,
the chunks a client asked to keep (`keep`) last; those keeps are journaled in the directory
(`engine/keeps.py`), so they outlive the process like the files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.keeps import KeepJournal, apply

log = logging.getLogger(__name__)

MAGIC = b"PKV1"
SUFFIX = ".kv"
QUEUE = 256  # chunks waiting to be written; more are dropped, never waited for
FREE_TO = 0.95  # an eviction round frees files down to this share of the capacity
# A durable keep is rounded up by this much, so that a kept chat's every turn (each pushes its
# keep a little further) does not journal all its keys again: about once an hour at most
KEEP_SLACK_S = 3600.0


def namespace(*parts) -> str:
    """The directory of one model / dtype / KV dtype / chunk size."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()


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


@dataclass
class Entry:
    size: int
    index: int  # the chunk's position in its conversation (its recompute cost grows with it)
    used: float  # last written or read


class DiskIndex:
    """The disk tier's bookkeeping, with no file and no tensor: the chunks it holds by key
    and their bytes against its capacity, which go first when it is over (the retention
    value), and which chunks of a dropped run are worth reading back (`load`). `DiskTier`
    keeps the chunks in files; a simulated device's tier (`engine/sim/disk.py`) only counts
    them and the time their bytes take."""

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


class DiskTier(DiskIndex):
    """The disk tier of a real device: the chunks in files under `root`/`space`."""

    def __init__(
        self,
        root: str | Path,
        capacity_bytes: int,
        space: str,
        cost: Callable[[int], float] | None = None,
        chunk_size: int = 32,
        read_limit_bps: float | None = None,
    ) -> None:
        super().__init__(capacity_bytes, cost, chunk_size)
        self.dir = Path(root) / space
        self.dir.mkdir(parents=True, exist_ok=True)
        # read_bps: measured (a probe at start, then a moving average over reads)
        self.read_limit_bps = read_limit_bps  # emulates a slower disk (benchmarks)
        self._scan()
        self.journal = KeepJournal(self.dir)
        self.kept = self.journal.compact(lambda key: key in self.index, self.now())
        self._probe()
        self._queue: queue.Queue = queue.Queue(QUEUE)
        self._writer = threading.Thread(target=self._write_loop, name="disk-writer", daemon=True)
        self._writer.start()

    # ---- the index ---------------------------------------------------------------------------

    def _scan(self) -> None:
        """Rebuild the index from the files (a warm restart), dropping temporary leftovers."""
        for path in self.dir.glob("*.tmp"):  # a probe cut short
            path.unlink(missing_ok=True)
        for path in self.dir.glob("*/*"):
            if path.suffix != SUFFIX:
                path.unlink(missing_ok=True)  # a write cut short by a crash
                continue
            key, index = _parse_name(path.name)
            if key is None:
                continue
            st = path.stat()
            self.index[key] = Entry(st.st_size, index, st.st_mtime)
            self.bytes += st.st_size

    def _probe(self, nbytes: int = 4 << 20) -> None:
        """A first read bandwidth, from a file written and read back at start."""
        path = self.dir / f"probe.{os.getpid()}.tmp"
        try:
            path.write_bytes(os.urandom(nbytes))
            t0 = time.perf_counter()
            data = path.read_bytes()
            self._throttle(len(data), t0)
            self.read_bps = len(data) / max(time.perf_counter() - t0, 1e-6)
        except OSError as e:
            log.warning("disk tier: no read probe (%s)", e)
        finally:
            path.unlink(missing_ok=True)

    def _throttle(self, nbytes: int, t0: float) -> None:
        if self.read_limit_bps:
            wait = nbytes / self.read_limit_bps - (time.perf_counter() - t0)
            if wait > 0:
                time.sleep(wait)

    def keep(self, keys: list[bytes], until: float) -> None:
        """Keep these chunks over any other until `until` (wall time) or up to KEEP_SLACK_S
        after, durably: the keeps that grow are journaled (not while the step loop waits:
        one append to a file, no fsync)."""
        grown = []
        with self.lock:
            for key in keys:
                if until > self.kept.get(key, 0.0):
                    self.kept[key] = until + KEEP_SLACK_S
                    grown.append((key, until + KEEP_SLACK_S))
        self.journal.append(grown)

    def remove(self, key: bytes, index: int) -> None:
        """Remove a chunk's file (a deleted conversation's), its keep (durably), and its
        write if it is still queued (one the writer has begun lands after this)."""
        with self.lock:
            self.pending.pop(key, None)
            kept = self.kept.pop(key, None) is not None
        if kept:
            self.journal.append([(key, 0.0)])
        self._forget(key, self.path(key, index))

    def clear(self) -> None:
        """Remove every file (benchmarks: runs that replay the same conversations must not
        find each other's chunks)."""
        self.flush()
        with self.lock:
            keys, self.index, self.bytes = list(self.index.items()), {}, 0
        for key, e in keys:
            self.path(key, e.index).unlink(missing_ok=True)

    def path(self, key: bytes, index: int) -> Path:
        h = key.hex()
        return self.dir / h[:2] / f"{h}-{index}{SUFFIX}"

    def has(self, key: bytes, index: int) -> bool:
        """Also a file another process wrote (replicas sharing the directory)."""
        return super().has(key, index) or self.path(key, index).exists()

    # ---- writes ------------------------------------------------------------------------------

    def put(self, key: bytes, index: int, parts: list[torch.Tensor], wait: bool = False) -> bool:
        """Queue a chunk (host tensors the caller no longer writes) to be written; False if
        it is not (the queue is full, the disk refused writes, or it is there already).
        `wait`: for room in the queue (a graceful stop), never from the step loop."""
        if not self.writable or key in self.index or key in self.pending:
            return False
        with self.lock:  # before the writer can take it (it pops it when written)
            self.pending[key] = parts
        try:
            self._queue.put((key, index, parts), block=wait, timeout=30 if wait else None)
            return True
        except queue.Full:
            with self.lock:
                self.pending.pop(key, None)
            self.skipped += 1
            return False

    def seed(self, key: bytes, index: int, parts: list[torch.Tensor], size: int) -> None:
        """Write the chunk's file now (a seeded state: its KV is whatever `parts` hold)."""
        self._write(key, index, parts)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued chunk is written (tests, shutdown)."""
        end = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.005)

    def close(self) -> None:
        """Write what is queued, then end the writer thread."""
        self._queue.put(None)
        self._writer.join(timeout=60)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            key, index, parts = item
            try:
                with self.lock:
                    wanted = key in self.pending  # not removed meanwhile
                if wanted:
                    self._write(key, index, parts)
            except OSError as e:  # full or read-only: stop writing, serving goes on
                self.failed += 1
                self.writable = False
                log.warning("disk tier stops writing: %s", e)
            except Exception:
                self.failed += 1
                log.exception("disk tier write failed")
            finally:
                with self.lock:
                    self.pending.pop(key, None)
                self._queue.task_done()

    def _write(self, key: bytes, index: int, parts: list[torch.Tensor]) -> None:
        payload = b"".join(p.contiguous().view(torch.uint8).numpy().tobytes() for p in parts)
        header = json.dumps(
            {
                "index": index,
                "parts": [[list(p.shape), str(p.dtype).removeprefix("torch.")] for p in parts],
                "bytes": len(payload),
                "crc32": zlib.crc32(payload),
            }
        ).encode()
        path = self.path(key, index)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<I", len(header)) + header + payload)
        os.replace(tmp, path)  # readers see the whole file or none
        self._add(key, index, path.stat().st_size)

    def _evict(self) -> None:
        """Evict as the index says, with the keeps other processes sharing the directory
        journaled since (on the writer thread: never the step loop's wait)."""
        new = self.journal.read_new()
        if new:
            with self.lock:
                apply(self.kept, new)
        super()._evict()

    def _evicted(self, gone: list[tuple[bytes, Entry]]) -> None:
        for key, e in gone:
            self.path(key, e.index).unlink(missing_ok=True)

    # ---- reads -------------------------------------------------------------------------------

    def read(self, key: bytes, index: int) -> list[torch.Tensor] | None:
        """The chunk's tensors, or None when its file is missing, cut short or corrupted (a
        bad file is removed: the chunk is recomputed)."""
        with self.lock:
            queued = self.pending.get(key)
        if queued is not None:  # dropped a moment ago: still in memory
            return queued
        path = self.path(key, index)
        t0 = time.perf_counter()
        try:
            data = path.read_bytes()
        except OSError:
            return None
        self._throttle(len(data), t0)
        parts = _decode(data)
        if parts is None:
            log.warning("disk tier: %s is damaged; recomputing instead", path.name)
            self._forget(key, path)
            return None
        elapsed = time.perf_counter() - t0
        bps = len(data) / max(elapsed, 1e-6)
        with self.lock:
            self.read_bps = bps if self.read_bps is None else 0.8 * self.read_bps + 0.2 * bps
        self._used(key)
        return parts

    def _forget(self, key: bytes, path: Path) -> None:
        path.unlink(missing_ok=True)
        self._unindex(key)


def _parse_name(name: str) -> tuple[bytes | None, int]:
    stem = name.removesuffix(SUFFIX)
    h, _, index = stem.partition("-")
    try:
        return bytes.fromhex(h), int(index)
    except ValueError:
        return None, 0


def _decode(data: bytes) -> list[torch.Tensor] | None:
    if len(data) < 8 or data[:4] != MAGIC:
        return None
    (n,) = struct.unpack("<I", data[4:8])
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError:
        return None
    payload = data[8 + n :]
    if len(payload) != header.get("bytes") or zlib.crc32(payload) != header.get("crc32"):
        return None
    parts, at = [], 0
    buf = bytearray(payload)  # writable: tensors over it own no other memory
    for shape, dtype in header["parts"]:
        dt = getattr(torch, dtype)
        count = 1
        for d in shape:
            count *= d
        size = count * torch.empty((), dtype=dt).element_size()
        parts.append(
            torch.frombuffer(buf, dtype=torch.uint8, count=size, offset=at).view(dt).view(shape)
        )
        at += size
    return parts
