"""A per-key token bucket: how many of an action a client may take per minute."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class RateLimit:
    per_minute: int
    max_keys: int = 100_000  # memory bound: the longest-unused keys are forgotten first
    clock: object = time.monotonic
    _buckets: OrderedDict[str, tuple[float, float]] = field(default_factory=OrderedDict)

    def take(self, key: str) -> float:
        """0 when `key` may act now (and it is counted), else the seconds until it may."""
        now = self.clock()
        rate = self.per_minute / 60.0
        tokens, last = self._buckets.pop(key, (float(self.per_minute), now))
        tokens = min(float(self.per_minute), tokens + (now - last) * rate)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / rate
        self._buckets[key] = (tokens, now)
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return wait


def retry_after(seconds: float) -> str:
    """A Retry-After header value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))
