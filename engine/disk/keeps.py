"""The disk tier's keeps made durable: which chunks a client asked to keep there
(`prompt_cache_retention`) and until when, in the tier's own directory, so that a restart
or a deploy keeps them too.

One append-only file, `kept.log`, of `<hex key> <until>` lines (wall time; an until of 0
drops the key's keep: a deleted conversation's). Every process sharing the directory
(replicas on shared storage) appends to it with O_APPEND, one write a call and never an
fsync: a crash may lose the last lines, which loses their durability only. Read in order,
the lines rebuild the keeps as `ChunkFiles.keep` and `remove` made them (the furthest until
wins, 0 removes); a torn or garbage line is skipped. A tier compacts the file when it starts
(expired keeps and keys without a file go) and writes it anew beside it, then renames it
over: under an exclusive lock of `kept.lock`, which appenders take shared, so no line a
peer appends meanwhile is lost. Any failure is logged and loses the durability alone."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

NAME = "kept.log"


class KeepJournal:
    def __init__(self, directory: Path) -> None:
        self.path = directory / NAME
        self.lock_path = directory / "kept.lock"
        self._read_at = (0, 0)  # (inode, offset): where `read_new` goes on in the file
        self._failing = False  # log a failing disk once, not on every keep

    def append(self, entries: Iterable[tuple[bytes, float]]) -> None:
        """Append these keeps (until 0: the key's keep is dropped); never raises."""
        data = "".join(f"{key.hex()} {until:.3f}\n" for key, until in entries).encode()
        if not data:
            return
        try:
            with self._locked(fcntl.LOCK_SH):
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, data)
                finally:
                    os.close(fd)
        except OSError as e:
            if not self._failing:
                log.warning("disk tier: keeps are not durable now (%s)", e)
            self._failing = True
            return
        self._failing = False

    def compact(self, live: Callable[[bytes], bool], now: float) -> dict[bytes, float]:
        """The keeps in force (after `now`, of keys `live` says the tier holds), and the file
        rewritten to hold only those."""

        def in_force(data: bytes) -> dict[bytes, float]:
            return {k: t for k, t in apply({}, parse(data)).items() if t > now and live(k)}

        try:
            with self._locked(fcntl.LOCK_EX):
                kept = in_force(self._read(0)[0])
                tmp = self.path.with_name(NAME + ".new")  # one compaction at a time: the lock
                tmp.write_text("".join(f"{k.hex()} {t:.3f}\n" for k, t in kept.items()))
                os.replace(tmp, self.path)  # appenders wait for the lock: no line is lost
                st = self.path.stat()
                self._read_at = (st.st_ino, st.st_size)
                return kept
        except OSError as e:  # a read-only directory: the keeps as read, not compacted
            log.warning("disk tier: could not compact %s (%s)", self.path, e)
        try:
            data, inode = self._read(0)
        except OSError:
            return {}
        self._read_at = (inode, data.rfind(b"\n") + 1)
        return in_force(data)

    def read_new(self) -> list[tuple[bytes, float]]:
        """The lines appended since the last read (all of them if a peer compacted the file
        meanwhile); complete lines only (one may be being written)."""
        inode, offset = self._read_at
        try:
            now_inode = self.path.stat().st_ino
            start = offset if now_inode == inode else 0
            data, _ = self._read(start)
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self._read_at = (now_inode, start + end)
        return parse(data[:end])

    def _read(self, offset: int) -> tuple[bytes, int]:
        try:
            with open(self.path, "rb") as f:
                f.seek(offset)
                return f.read(), os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            return b"", 0

    @contextlib.contextmanager
    def _locked(self, how: int) -> Iterator[None]:
        with open(self.lock_path, "a") as f:
            fcntl.flock(f, how)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def parse(data: bytes) -> list[tuple[bytes, float]]:
    """The well-formed `<hex key> <until>` lines of `data`, in order; others are skipped."""
    out = []
    for line in data.split(b"\n"):
        fields = line.split()
        if len(fields) != 2:
            continue
        try:
            key, until = bytes.fromhex(fields[0].decode("ascii")), float(fields[1])
        except (UnicodeDecodeError, ValueError):
            continue
        if key and math.isfinite(until) and until >= 0:
            out.append((key, until))
    return out


def apply(kept: dict[bytes, float], entries: Iterable[tuple[bytes, float]]) -> dict[bytes, float]:
    """Replay lines onto `kept` (changed in place, and returned): the furthest until wins, 0
    drops the key."""
    for key, until in entries:
        if until == 0:
            kept.pop(key, None)
        else:
            kept[key] = max(until, kept.get(key, 0.0))
    return kept
