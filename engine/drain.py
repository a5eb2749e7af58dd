"""How fast the engine's queue drains: turns ended per second over the last ones seen, and
the wait it implies for a turn refused at a full queue (the `Retry-After` a client gets)."""

from __future__ import annotations

import threading
from collections import deque

DEFAULT_S = 1.0  # too few turns seen yet to measure a rate
MIN_S, MAX_S = 1.0, 60.0  # a client retries no sooner than 1 s, and never waits minutes
WINDOW = 64  # the last turns ended: a rate that follows the load within seconds


class DrainRate:
    def __init__(self, window: int = WINDOW) -> None:
        self._ends: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()  # the loop thread writes, the event loop reads

    def ended(self, now: float) -> None:
        """A turn ended at `now` (monotonic seconds)."""
        with self._lock:
            self._ends.append(now)

    def per_s(self, now: float) -> float | None:
        """Turns ended per second over the window up to `now` (None: fewer than two seen)."""
        with self._lock:
            if len(self._ends) < 2:
                return None
            span = max(now, self._ends[-1]) - self._ends[0]
            return (len(self._ends) - 1) / span if span > 0 else None

    def wait_s(self, queued: int, now: float) -> float:
        """Seconds until a turn queued behind `queued` others would be taken."""
        rate = self.per_s(now)
        if rate is None:
            return DEFAULT_S
        return min(MAX_S, max(MIN_S, (queued + 1) / rate))
