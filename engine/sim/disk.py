"""The disk tier of a simulated device, and reads off the step loop in virtual time.

`SimDisk` is the real tier's bookkeeping (`engine.disk.index.DiskIndex`: the index by key, the
capacity kept by retention value, the choice of what to read back) with no file and no
tensor: a chunk is a key and a size. Its bytes take the time the device's drive needs
(`devices.Disk`), in the order the real engine moves them:
- a read happens off the step loop, with the turn's history read: the turn waits for it
  (`VirtualRead`), the other turns go on; reads queue behind each other at the drive's read
  rate. Then the chunks go to the GPU layer by layer beside the forward, like a swap-in
  (`SimPool`);
- a write never holds up a step (the real tier's writer thread): it queues behind the
  writes before it at the drive's write rate, and, as there, a write that finds `QUEUE`
  chunks waiting is dropped. One drive does both: reads go first, and the writes waiting
  wait for them too.
Simplified: reads never wait for a write under way; a chunk is indexed (and counts against
the capacity) when its write is queued, not when it lands; a chunk still queued reads at
the drive's rate (the real tier reads it from memory).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from engine.disk.index import QUEUE, DiskIndex
from engine.sim.clock import VirtualClock
from engine.sim.devices import Disk


class SimDisk(DiskIndex):
    def __init__(
        self,
        drive: Disk,
        clock: VirtualClock,
        capacity_bytes: int,
        chunk_bytes: int,
        cost: Callable[[int], float] | None = None,
        chunk_size: int = 32,
    ) -> None:
        super().__init__(capacity_bytes, cost, chunk_size, now=clock)
        self.drive = drive
        self.clock = clock
        self.chunk_bytes = chunk_bytes
        self.read_bps = drive.read_bps
        self.read_until = 0.0  # when the reads asked for so far are done
        self.write_until = 0.0  # when the writes queued so far are done
        # When each queued write lands, less `_shift`: the time reads put in front of the
        # writes since (one sum moves every queued write at once)
        self._writing: deque[float] = deque()
        self._shift = 0.0

    def _landed(self, now: float) -> None:
        while self._writing and self._writing[0] + self._shift <= now:
            self._writing.popleft()

    def put(self, key: bytes, index: int, parts: list, wait: bool = False) -> bool:
        if not self.writable or key in self.index:
            return False
        now = self.clock()
        self._landed(now)
        if len(self._writing) >= QUEUE and not wait:
            self.skipped += 1
            return False
        start = max(now, self.write_until, self.read_until)
        self.write_until = start + self.chunk_bytes / self.drive.write_bps
        self._writing.append(self.write_until - self._shift)
        self._add(key, index, self.chunk_bytes)
        return True

    def read(self, key: bytes, index: int) -> list | None:
        """No tensors (the simulated pool holds none): [] for a chunk the tier holds."""
        if key not in self.index:
            return None
        now = self.clock()
        seconds = self.chunk_bytes / self.read_bps
        self.read_until = max(now, self.read_until) + seconds
        self._landed(now)
        if self._writing:  # the writes waiting wait for the read too
            self.write_until += seconds
            self._shift += seconds
        self._used(key)
        return []


class VirtualRead:
    """A read off the step loop (the history, and the disk tier's chunks), as a future in
    virtual time: computed at once, done when the clock reaches `due`."""

    def __init__(self, clock: VirtualClock, due: float, value: Any, error: BaseException | None):
        self.clock = clock
        self.due = due
        self.value = value
        self.error = error

    def done(self) -> bool:
        return self.clock() >= self.due

    def exception(self) -> BaseException | None:
        return self.error

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value
