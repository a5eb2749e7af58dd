"""Activity clock over a Redis sorted set, served from an in-process mirror."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

KEY = "pensieve:activity"


def _safe(url: str) -> str:
    """The URL without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class RedisClock:
    """ActivityClock whose reads and writes never wait on the network.

    last_active() reads a local mirror and touch() writes it at once. A background task on
    the app's loop pushes touches to the sorted set `key` (score: unix time) and every
    `interval` seconds reloads the mirror from it, so times written by other servers or
    operators reach the engine. While Redis is unreachable the clock keeps serving the
    mirror, reports healthy=False, and retries; on recovery it re-sends every local time
    newer than Redis's (a restarted Redis may have lost them).
    """

    def __init__(
        self,
        url: str,
        *,
        key: str = KEY,
        interval: float = 0.5,
        timeout: float = 1.0,
        now: Callable[[], float] = time.time,
    ) -> None:
        self.url = url
        self.key = key
        self._where = _safe(url)
        self.interval = interval
        self.healthy = False
        self.last_error: str | None = "not started"
        self._now = now
        self._redis = aioredis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),  # the loop below is the retry
            decode_responses=True,
        )
        self._times: dict[str, float] = {}  # the mirror; replaced whole on refresh
        self._pending: dict[str, float] = {}  # touched, not yet in Redis
        self._forgotten: set[str] = set()  # forgotten, not yet removed from Redis
        self._lock = threading.Lock()  # touch() may come from any thread
        self._task: asyncio.Task[None] | None = None
        self._resync = False  # push the whole mirror on the next successful sync
        self._started = False  # logs only transitions after the first sync

    # ActivityClock.

    def last_active(self, conversation_id: str) -> float | None:
        return self._times.get(conversation_id)

    def touch(self, conversation_id: str, when: float | None = None) -> None:
        t = self._now() if when is None else float(when)
        if not math.isfinite(t):
            raise ValueError(f"activity time must be a finite unix time, got {when!r}")
        with self._lock:
            self._times[conversation_id] = t
            self._pending[conversation_id] = t
            self._forgotten.discard(conversation_id)

    def forget(self, conversation_id: str) -> None:
        with self._lock:
            self._times.pop(conversation_id, None)
            self._pending.pop(conversation_id, None)
            self._forgotten.add(conversation_id)

    # Lifecycle, on the app's loop.

    async def start(self) -> None:
        """One sync now (so `healthy` is meaningful at once), then sync in the background."""
        if self._task is not None:
            return
        await self._sync_once()
        self._started = True
        self._task = asyncio.get_running_loop().create_task(self._run(), name="redis-clock")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await self._sync_once()  # last pending touches, best effort
        await self._redis.aclose()

    async def sync(self) -> bool:
        """Push and refresh now; True when Redis answered. For tests and shutdown."""
        await self._sync_once()
        return self.healthy

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self._sync_once()

    async def _sync_once(self) -> None:
        try:
            await self._sync()
        except (TimeoutError, RedisError, OSError) as e:
            self._down(e)
        except Exception as e:  # a bug must not stop the clock's retries
            log.exception("redis activity clock sync failed")
            self._down(e)
        else:
            self._up()

    async def _sync(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            forgotten, self._forgotten = self._forgotten, set()
            everything = dict(self._times) if self._resync else {}
        try:
            pipe = self._redis.pipeline(transaction=True)
            if everything:
                pipe.zadd(self.key, everything, gt=True)
            if forgotten:
                pipe.zrem(self.key, *forgotten)
            if pending:
                pipe.zadd(self.key, pending)
            pipe.zrange(self.key, 0, -1, withscores=True)
            remote = dict((await pipe.execute())[-1])
        except BaseException:
            with self._lock:  # not sent: keep for the next try; what came in meanwhile wins
                kept = {k: v for k, v in pending.items() if k not in self._forgotten}
                self._pending = kept | self._pending
                self._forgotten = (forgotten - self._pending.keys()) | self._forgotten
            raise
        with self._lock:
            # Touches and forgets that came in while Redis answered stay as they are.
            for cid in self._forgotten:
                remote.pop(cid, None)
            remote.update(self._pending)
            self._times = remote
            self._resync = False

    def _down(self, e: BaseException) -> None:
        self.last_error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        if self.healthy or not self._started:
            log.warning(
                "redis activity clock unreachable at %s (%s); serving local times",
                self._where,
                self.last_error,
            )
        self.healthy = False
        self._resync = True

    def _up(self) -> None:
        if not self.healthy and self._started:
            log.warning("redis activity clock reachable again at %s", self._where)
        self.healthy = True
        self.last_error = None
