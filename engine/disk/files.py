"""The disk tier's chunks in files that outlive the process, keyed by what they hold.

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
go as the index says (index.py); the keeps are journaled in the directory (keeps.py), so
they outlive the process like the files.
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
from pathlib import Path

import torch

from engine.disk.index import QUEUE, DiskIndex, Entry
from engine.disk.keeps import KeepJournal, apply

log = logging.getLogger(__name__)

MAGIC = b"PKV1"
SUFFIX = ".kv"
# A durable keep is rounded up by this much, so that a kept chat's every turn (each pushes its
# keep a little further) does not journal all its keys again: about once an hour at most
KEEP_SLACK_S = 3600.0


def namespace(*parts) -> str:
    """The directory of one model / dtype / KV dtype / chunk size."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()


class ChunkFiles(DiskIndex):
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
        payload = b"".join(raw_bytes(p) for p in parts)
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


# Same-sized integer types: numpy has no bfloat16 or float8, but copies their bits as these
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw_bytes(t: torch.Tensor) -> bytes:
    """A CPU tensor's bytes in C order, strided or not, copied by numpy: a torch copy on the
    writer thread can start an OpenMP team of that thread's own, and more OpenMP threads
    than cores slow every parallel op of the step loop (docs/internals.md, "One thread for
    the model")."""
    return t.view(_BITS[t.element_size()]).numpy().tobytes()


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
