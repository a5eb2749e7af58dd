"""The replica directory in Redis: which replicas live, and which one is each conversation's
home (the replica whose engine holds its cache).

Keys (a standalone Redis; the scripts name keys they compute, which Redis Cluster forbids):

- `pensieve:replicas`: the set of replica ids ever registered (for the admin listing).
- `pensieve:replica:{id}`: a hash of what a replica says of itself (url, pid, started,
  last_seen, health, pools, conversations), rewritten by each heartbeat; no TTL, so a dead
  replica is still listed, as down.
- `pensieve:alive:{id}`: the replica's `started` time, with a TTL of a few heartbeats. A
  replica is alive while this key exists.
- `pensieve:home:{conversation}`: the home replica's id, with a TTL the home refreshes while
  it lives.

Claims are atomic (Lua): a conversation's home changes only when it has none, or when its
home is no longer alive (or the caller found it unreachable), so two replicas never both
take over the same conversation.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

PREFIX = "pensieve:"

# Returns {home, url, started, previous}: the live home other than ARGV[1], or ARGV[1] after
# it claimed the conversation (previous: the home it replaced, "" when there was none).
CLAIM = """
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] and cur ~= ARGV[3] then
  local started = redis.call('GET', ARGV[4] .. 'alive:' .. cur)
  if started then
    local url = redis.call('HGET', ARGV[4] .. 'replica:' .. cur, 'url') or ''
    return {cur, url, started, cur}
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return {ARGV[1], '', '', cur or ''}
"""

# Refresh the TTL of each home key still naming ARGV[1] (set it again where it vanished, e.g.
# a restarted Redis); returns the 1-based indexes of keys another replica now holds.
REFRESH = """
local lost = {}
for i, key in ipairs(KEYS) do
  local cur = redis.call('GET', key)
  if cur == ARGV[1] then
    redis.call('EXPIRE', key, ARGV[2])
  elseif not cur then
    redis.call('SET', key, ARGV[1], 'EX', ARGV[2])
  else
    table.insert(lost, i)
  end
end
return lost
"""

# Delete each home key that still names ARGV[1].
RELEASE = """
local n = 0
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then redis.call('DEL', key); n = n + 1 end
end
return n
"""


@dataclass(frozen=True)
class Home:
    """A conversation's home as the directory says: `replica` (its id), its `url` and
    `started` time (which tells a restarted replica from the one found dead), and the
    replica this claim replaced ("" when none)."""

    replica: str
    url: str = ""
    started: str = ""
    previous: str = ""


class Directory:
    """The directory for one replica `me`. Every call is one round trip; errors are the
    caller's (RedisError, OSError, TimeoutError)."""

    def __init__(
        self,
        url: str,
        me: str,
        *,
        alive_ttl_s: float = 5.0,
        home_ttl_s: float = 60.0,
        timeout_s: float = 1.0,
        prefix: str = PREFIX,
    ) -> None:
        self.me = me
        self.alive_ttl_ms = max(1, round(alive_ttl_s * 1000))
        self.home_ttl_s = max(1, round(home_ttl_s))
        self.prefix = prefix
        self.redis = aioredis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
        )
        self._claim = self.redis.register_script(CLAIM)
        self._refresh = self.redis.register_script(REFRESH)
        self._release = self.redis.register_script(RELEASE)

    def home_key(self, conversation_id: str) -> str:
        return f"{self.prefix}home:{conversation_id}"

    async def close(self) -> None:
        await self.redis.aclose()

    # --- replicas -----------------------------------------------------------------------
    async def heartbeat(self, started: float, info: dict) -> None:
        """Say this replica lives, with what it reports of itself (JSON-able values)."""
        fields = {k: v if isinstance(v, str) else json.dumps(v) for k, v in info.items()}
        fields.update(id=self.me, started=repr(started), last_seen=repr(time.time()))
        pipe = self.redis.pipeline(transaction=True)
        pipe.sadd(f"{self.prefix}replicas", self.me)
        pipe.hset(f"{self.prefix}replica:{self.me}", mapping=fields)
        pipe.set(f"{self.prefix}alive:{self.me}", repr(started), px=self.alive_ttl_ms)
        await pipe.execute()

    async def leave(self) -> None:
        """This replica stops: it is no longer alive (its homes pass on at once)."""
        await self.redis.delete(f"{self.prefix}alive:{self.me}")

    async def replicas(self) -> list[dict]:
        """Every registered replica: its last report, and `alive`."""
        ids = sorted(await self.redis.smembers(f"{self.prefix}replicas"))
        pipe = self.redis.pipeline(transaction=False)
        for rid in ids:
            pipe.hgetall(f"{self.prefix}replica:{rid}")
            pipe.get(f"{self.prefix}alive:{rid}")
        answers = await pipe.execute() if ids else []
        out = []
        for rid, info, alive in zip(ids, answers[::2], answers[1::2], strict=True):
            entry: dict = {"id": rid}
            for k, v in info.items():
                try:
                    entry[k] = json.loads(v)
                except ValueError:
                    entry[k] = v
            entry["alive"] = alive is not None and alive == info.get("started")
            out.append(entry)
        return out

    async def forget_replica(self, replica: str) -> None:
        """Remove a replica from the listing (an operator retired it)."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.srem(f"{self.prefix}replicas", replica)
        pipe.delete(f"{self.prefix}replica:{replica}", f"{self.prefix}alive:{replica}")
        await pipe.execute()

    # --- homes --------------------------------------------------------------------------
    async def home(self, conversation_id: str) -> str | None:
        return await self.redis.get(self.home_key(conversation_id))

    async def claim(self, conversation_id: str, dead: str = "") -> Home:
        """The conversation's live home; this replica when it had none, its home is not
        alive, or its home is `dead` (the caller could not reach it)."""
        home, url, started, previous = await self._claim(
            keys=[self.home_key(conversation_id)],
            args=[self.me, self.home_ttl_s, dead, self.prefix],
        )
        return Home(home, url, started, previous)

    async def refresh(self, conversation_ids: list[str]) -> list[str]:
        """Keep this replica's homes alive; returns those another replica took meanwhile."""
        if not conversation_ids:
            return []
        keys = [self.home_key(c) for c in conversation_ids]
        lost = await self._refresh(keys=keys, args=[self.me, self.home_ttl_s])
        return [conversation_ids[int(i) - 1] for i in lost]

    async def release(self, conversation_ids: list[str]) -> int:
        """Give up homes this replica holds (a deleted chat, a cache no longer held)."""
        if not conversation_ids:
            return 0
        keys = [self.home_key(c) for c in conversation_ids]
        return int(await self._release(keys=keys, args=[self.me]))
