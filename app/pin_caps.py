"""Per-owner caps of pinned memory (`max_pinned_mb_per_owner`) held across replicas through
Redis, so that N replicas never let an owner pin N times its cap; held per replica where
there is no Redis, and while it is down (logged once an outage).

Redis keeps a hash per owner: conversation id -> "bytes until" (until: the pin's end in
wall time), each replica writing its view of the pins its engine holds: the projected size
when a turn's pin is reserved, what its chunks hold when the turn ends, nothing once the pin
is let go. A reservation sums the owner's live pins but this conversation's and records
this one in one Lua script, so two replicas reserving at once cannot both pass the cap.
Expired pins are dropped as they are met. The engine checks its own pins against the cap
too (engine/cache/pins.py): that local count is what holds while Redis is down; this
replica's own entries, mirrored here, are written back when Redis returns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

PREFIX = "pensieve-pins:"
RETRY_S = 5.0  # after a Redis failure, local counting for this long before Redis is tried again

# KEYS[1] the owner's hash; ARGV: conversation, bytes, until, cap (-1: none), now.
# Returns -1 when recorded, else the bytes the owner's other live pins hold.
RESERVE = """
local key, cid = KEYS[1], ARGV[1]
local size, untl, cap, now = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local used, all = 0, redis.call('HGETALL', key)
for i = 1, #all, 2 do
  local b, u = string.match(all[i + 1], '^(%d+) (%S+)$')
  if tonumber(u) <= now then
    redis.call('HDEL', key, all[i])
  elseif all[i] ~= cid then
    used = used + tonumber(b)
  end
end
if cap >= 0 and used + size > cap then return used end
redis.call('HSET', key, cid, string.format('%d %.3f', size, untl))
local ttl = math.ceil(untl - now)
if redis.call('TTL', key) < ttl then redis.call('EXPIRE', key, ttl) end
return -1
"""

Pins = dict[str, tuple[int, float]]  # conversation id -> (bytes, until)


class PinCaps:
    def __init__(
        self,
        redis_url: str | None = None,
        timeout_s: float = 0.5,
        now: Callable[[], float] = time.time,
    ) -> None:
        self.now = now
        self.local: dict[str, Pins] = {}  # this replica's pins, per owner
        self.redis: aioredis.Redis | None = None
        if redis_url:
            self.redis = aioredis.from_url(
                redis_url,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),  # a failure falls back at once
            )
            self.script = self.redis.register_script(RESERVE)
        self.down_until = 0.0  # while Redis is down: local counts until then
        self.healthy = self.redis is not None

    async def reserve(
        self, owner: str, conversation_id: str, size: int, ttl_s: float, cap: int
    ) -> int | None:
        """Pin `size` bytes of the conversation for `ttl_s` from now if its owner's live pins
        stay within `cap` with it: None when recorded, else the bytes the owner's other pins
        hold (nothing recorded)."""
        until = self.now() + ttl_s
        used = await self._write(owner, conversation_id, size, until, cap)
        if used is None:
            self.local.setdefault(owner, {})[conversation_id] = (size, until)
        return used

    async def hold(self, owner: str, conversation_id: str, size: int, until: float) -> None:
        """This replica's engine holds the conversation's pin: `size` bytes until then
        (wall time), whatever the cap (it was accepted)."""
        self.local.setdefault(owner, {})[conversation_id] = (size, until)
        await self._write(owner, conversation_id, size, until, None)

    async def forget(self, owner: str, conversation_id: str) -> None:
        """The conversation's pin is let go (a finished session, a deleted chat)."""
        self.local.get(owner, {}).pop(conversation_id, None)
        await self._shared(lambda r: r.hdel(PREFIX + owner, conversation_id))

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()

    # ---- internals ----------------------------------------------------------------------

    async def _write(
        self, owner: str, cid: str, size: int, until: float, cap: int | None
    ) -> int | None:
        args = [cid, size, until, -1 if cap is None else cap, self.now()]
        result = await self._shared(lambda _: self.script(keys=[PREFIX + owner], args=args))
        if result is None:  # no Redis to ask: this replica's own pins decide
            used = self._local_used(owner, cid)
            return None if cap is None or used + size <= cap else used
        return None if int(result) < 0 else int(result)

    def _local_used(self, owner: str, cid: str) -> int:
        now, pins = self.now(), self.local.get(owner, {})
        for gone in [c for c, (_, until) in pins.items() if until <= now]:
            del pins[gone]
        return sum(b for c, (b, _) in pins.items() if c != cid)

    async def _shared(self, op: Callable[[aioredis.Redis], object]):
        """`op` on Redis; None without Redis, or while it is down (said once an outage)."""
        if self.redis is None or self.now() < self.down_until:
            return None
        try:
            result = await op(self.redis)
            if not self.healthy:
                await self._write_back()
        except (RedisError, OSError, TimeoutError) as e:
            if self.healthy:
                log.warning(
                    "Redis is down (%s): pin caps are counted per replica until it is back", e
                )
            self.healthy = False
            self.down_until = self.now() + RETRY_S
            return None
        if not self.healthy:
            log.warning("Redis is back: pin caps are shared by every replica again")
            self.healthy = True
        return result

    async def _write_back(self) -> None:
        """Redis is back: what this replica pinned meanwhile goes into it (unchecked: its
        engine holds those pins already; a restarted Redis lost them)."""
        now = self.now()
        for owner, pins in self.local.items():
            for cid, (size, until) in list(pins.items()):
                if until > now:
                    await self.script(keys=[PREFIX + owner], args=[cid, size, until, -1, now])
