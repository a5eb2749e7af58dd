"""How much CPU other processes took while a benchmark ran on a shared machine (Linux): with
one more busy process, threads that meet at a barrier every op (llama.cpp's, OpenMP's) wait
for each other's time slices. `Meter`: the machine's CPU time (/proc/stat) less this process
tree's (the servers it started), in cores; `wait_quiet` waits until that stays low.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def busy_ticks(stat: str | None = None) -> int:
    """All CPUs' non-idle time from /proc/stat's first line (idle and iowait excluded)."""
    text = stat if stat is not None else Path("/proc/stat").read_text()
    fields = [int(x) for x in text.splitlines()[0].split()[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice: inside user, nice]
    return sum(fields[:8]) - fields[3] - fields[4]


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, user + system ticks) of a process, or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = text[text.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
    return int(rest[1]), int(rest[11]) + int(rest[12])


def tree_ticks(root: int) -> int:
    """CPU ticks of `root` and every live descendant."""
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            s = _stat(int(entry.name))
            if s is not None:
                stats[int(entry.name)] = s
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0))[1]
        todo.extend(children.get(pid, []))
    return total


def others_cores(busy: int, ours: int, seconds: float) -> float:
    """Cores other processes kept busy: the machine's busy ticks less ours, per second."""
    return max(0, busy - ours) / TICK / seconds if seconds > 0 else 0.0


@dataclass
class Meter:
    """Others' CPU over a span: `start()`, then `cores()` (our servers must still be alive
    at both ends: a process that exits in between takes its ticks with it)."""

    root: int = field(default_factory=os.getpid)
    _t: float = 0.0
    _busy: int = 0
    _ours: int = 0

    def start(self) -> Meter:
        self._t, self._busy, self._ours = time.monotonic(), busy_ticks(), tree_ticks(self.root)
        return self

    def cores(self) -> float:
        busy, ours = busy_ticks() - self._busy, tree_ticks(self.root) - self._ours
        return others_cores(busy, ours, time.monotonic() - self._t)


def wait_quiet(limit: float, window: float = 3.0, timeout: float = 600.0) -> float:
    """Wait until other processes use under `limit` cores over `window` seconds, at most
    `timeout` seconds; the seconds waited."""
    t0 = time.monotonic()
    while True:
        meter = Meter().start()
        time.sleep(window)
        if meter.cores() < limit or time.monotonic() - t0 > timeout:
            return time.monotonic() - t0
