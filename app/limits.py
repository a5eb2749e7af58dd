"""Per-key quotas a minute (the turns an owner sends, the new users a client address makes),
shared by every replica through Redis, so that N replicas never give a client N times its
quota; held per replica where there is no Redis, and while it is down (logged once an outage).

Both ways count with the `limits` library's moving window: at most `per_minute` actions in
any 60 s, the wait until the oldest of them leaves the window.
"""

from __future__ import annotations

import logging
import math
import time

from limits import RateLimitItem, RateLimitItemPerMinute
from limits.aio.storage import MemoryStorage, RedisStorage, Storage
from limits.aio.strategies import MovingWindowRateLimiter
from limits.errors import StorageError

log = logging.getLogger(__name__)

PREFIX = "pensieve-limits"
RETRY_S = 5.0  # after a Redis failure, local counting for this long before Redis is tried again


class Quotas:
    def __init__(self, redis_url: str | None = None, timeout_s: float = 0.5) -> None:
        self.local = MovingWindowRateLimiter(MemoryStorage())
        self.shared: MovingWindowRateLimiter | None = None
        if redis_url:
            storage: Storage = RedisStorage(
                "async+" + redis_url,
                implementation="redispy",
                wrap_exceptions=True,  # any Redis failure is a StorageError
                key_prefix=PREFIX,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
            )
            self.shared = MovingWindowRateLimiter(storage)
        self.down_until = 0.0  # while Redis is down: local counts until then
        self.healthy = self.shared is not None

    async def take(self, kind: str, key: str, per_minute: int) -> float | None:
        """Count one action of `key` (of `kind`: "turns", "new-users"); None when it may act
        now, else the seconds until it may (nothing counted)."""
        item = RateLimitItemPerMinute(per_minute)
        if self.shared is None or time.monotonic() < self.down_until:
            return await self._take(self.local, item, kind, key)
        try:
            wait = await self._take(self.shared, item, kind, key)
        except StorageError as e:  # Redis refused or timed out: this replica counts alone
            if self.healthy:
                log.warning(
                    "Redis is down (%s): quotas are counted per replica until it is back", e
                )
            self.healthy = False
            self.down_until = time.monotonic() + RETRY_S
            return await self._take(self.local, item, kind, key)
        if not self.healthy:
            log.warning("Redis is back: quotas are shared by every replica again")
            self.healthy = True
        return wait

    @staticmethod
    async def _take(
        limiter: MovingWindowRateLimiter, item: RateLimitItem, kind: str, key: str
    ) -> float | None:
        if await limiter.hit(item, kind, key):
            return None
        reset, _ = await limiter.get_window_stats(item, kind, key)
        return max(0.1, round(reset - time.time(), 1))


def retry_after(seconds: float) -> str:
    """A Retry-After header value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))
