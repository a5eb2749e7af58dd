"""Virtual time: the clock a simulated engine reads, advanced by the simulated device."""

from __future__ import annotations


class VirtualClock:
    """Seconds since the simulation started. Calling it reads the time, as `time.time` does."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"time cannot go back ({seconds} s)")
        self.t += seconds

    def advance_to(self, t: float) -> None:
        """Jump to `t` (a later event); never back."""
        self.t = max(self.t, t)
