"""A client's retention applied to the cache: pins reserved when a turn is accepted (against
its owner's cap, sized for the context the turn may reach), run from the turn's end, what
the pins hold per tier, and a conversation's pins read out and put back across a restart in
wall time. The bookkeeping itself is `engine/cache/pins.py`; the disk tier's keep is the
disk tier's (`engine/conversations.py` asks it)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from engine.cache.chunks import ChunkTable
from engine.cache.pins import Retained
from engine.snapshot import PinUsage
from engine.types import Turn

if TYPE_CHECKING:
    from engine.cache.manager import KVCacheManager


class Retainer:
    """The cache's side of `prompt_cache_retention`: one per engine, over its cache."""

    def __init__(
        self, cache: KVCacheManager, bytes_per_chunk: int, now: Callable[[], float]
    ) -> None:
        self.cache = cache
        self.pins = cache.policy.pins
        self.bytes_per_chunk = bytes_per_chunk
        self.now = now

    def reserve(self, turn: Turn, length: int) -> None:
        """Before the turn is queued (its conversation `length` tokens long): pin it
        (PinRefused past its owner's cap, sized for the context the turn may reach), or
        mark it done (ttl_s 0), or set its priority."""
        r, cid = turn.retention, turn.conversation_id
        if r is None:
            return
        if r.ttl_s is None:
            self.pins.prioritize(cid, r.priority)
        elif r.ttl_s == 0:
            self.pins.finish(cid)
        else:
            upto = length + len(turn.prompt_token_ids) + turn.sampling.max_tokens
            size = self.size(upto)
            self.pins.reserve(cid, r.owner, r.ttl_s, r.priority, size, r.cap_bytes, self.now())

    def size(self, tokens: int) -> int:
        """The bytes a pin of a conversation `tokens` long counts against its owner's cap."""
        return self.cache.n_chunks(tokens) * self.bytes_per_chunk

    def settle(self, conversation_id: str, now: float) -> None:
        """The turn ended: a live pin of its conversation runs its ttl from now (every turn
        refreshes it), counting the bytes its chunks hold in memory."""
        if self.pins.held(conversation_id, now):
            table = self.cache.find(conversation_id)
            held = 0 if table is None else _held_chunks(table)
            self.pins.settle(conversation_id, now, held * self.bytes_per_chunk)

    def release(self, conversation_id: str) -> None:
        """Its client deleted it: its pin and priority go at once."""
        self.pins.release(conversation_id)

    def retained(self, conversation_id: str) -> Retained | None:
        """What the pins hold of the conversation, its pin's `until` in wall time (the
        engine's clock may be virtual, or any a test gives; a restarted engine's starts
        anew)."""
        now = self.now()
        r = self.pins.record(conversation_id, now)
        if r is None or r.ttl_s is None:
            return r
        return replace(r, until=r.until - now + time.time())

    def restore(self, kept: list[Retained]) -> int:
        """Put back what `retained` read out before a restart (`until` in wall time): the
        pins still in force, priorities, finished sessions. Returns the pins put back."""
        now = self.now()
        shift = now - time.time()
        return self.pins.restore([replace(r, until=r.until + shift) for r in kept], now)

    def usage(self, now: float) -> PinUsage:
        """Pinned conversations and the bytes their chunks take on each tier."""
        gpu = cpu = 0
        live = self.pins.live(now)
        for cid in live:
            table = self.cache.find(cid)
            if table is None:
                continue
            gpu += sum(1 for c in table.chunks if c.gpu is not None)
            cpu += sum(1 for c in table.chunks if c.cpu is not None)
        per = self.bytes_per_chunk
        return PinUsage(len(live), gpu * per, cpu * per)


def _held_chunks(table: ChunkTable) -> int:
    return sum(1 for c in table.chunks if c.gpu is not None or c.cpu is not None)
