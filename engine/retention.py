"""A client's retention applied to the cache: pins reserved when a turn is accepted (against
its owner's cap), run from the turn's end, the disk tier told to keep the conversation's
chunks, what the pins hold per tier, and a conversation's pins read out and put back across
a restart in wall time. The bookkeeping itself is `engine/cache/pins.py`."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

from engine.cache.chunks import ChunkTable
from engine.cache.pins import Retained
from engine.snapshot import PinUsage
from engine.types import Turn

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.request import Request


def reserve(engine: Engine, turn: Turn) -> None:
    """Before the turn is queued: pin its conversation (PinRefused past its owner's cap,
    sized for the context the turn may reach), or mark it done (ttl_s 0), or set its
    priority. ValueError for a disk retention without a disk tier."""
    r = turn.retention
    if r is None:
        return
    if r.disk_s and engine.disk is None:
        raise ValueError(
            "prompt_cache_retention: this server has no disk tier (disk_cache_dir) to keep "
            "a conversation's KV past memory"
        )
    pins, cid, now = engine.cache.policy.pins, turn.conversation_id, engine.now()
    if r.ttl_s is None:
        pins.prioritize(cid, r.priority)
    elif r.ttl_s == 0:
        pins.finish(cid)
    else:
        state = engine.streams.get(cid)
        length = turn.context_len if turn.context_len is not None else state.length if state else 0
        upto = length + len(turn.prompt_token_ids) + turn.sampling.max_tokens
        size = engine.cache.n_chunks(upto) * engine.pool.bytes_per_chunk
        pins.reserve(cid, r.owner, r.ttl_s, r.priority, size, r.cap_bytes, now)


def settle(engine: Engine, req: Request, now: float) -> None:
    """The turn ended: a live pin of its conversation runs its ttl from now (every turn
    refreshes it); a disk retention keeps its full chunks on the disk tier."""
    cid = req.state.id
    pins = engine.cache.policy.pins
    if pins.held(cid, now):
        table = engine.cache.find(cid)
        held = 0 if table is None else _held_chunks(table)
        pins.settle(cid, now, held * engine.pool.bytes_per_chunk)
    r = req.turn.retention
    if r is not None and r.disk_s and engine.disk is not None:
        engine.disk.keep(req.state, r.disk_s)


def retained(engine: Engine, conversation_id: str) -> Retained | None:
    """What the pins hold of the conversation, its pin's `until` in wall time (the engine's
    clock may be virtual, or any a test gives; a restarted engine's starts anew)."""
    now = engine.now()
    r = engine.cache.policy.pins.record(conversation_id, now)
    if r is None or r.ttl_s is None:
        return r
    return replace(r, until=r.until - now + time.time())


def restore(engine: Engine, kept: list[Retained]) -> int:
    """Put back what `retained` read out before a restart (`until` in wall time): the pins
    still in force, priorities, finished sessions. Returns the pins put back."""
    now = engine.now()
    shift = now - time.time()
    return engine.cache.policy.pins.restore([replace(r, until=r.until + shift) for r in kept], now)


def usage(engine: Engine, now: float) -> PinUsage:
    """Pinned conversations and the bytes their chunks take on each tier."""
    gpu = cpu = 0
    live = engine.cache.policy.pins.live(now)
    for cid in live:
        table = engine.cache.find(cid)
        if table is None:
            continue
        gpu += sum(1 for c in table.chunks if c.gpu is not None)
        cpu += sum(1 for c in table.chunks if c.cpu is not None)
    per = engine.pool.bytes_per_chunk
    return PinUsage(len(live), gpu * per, cpu * per)


def _held_chunks(table: ChunkTable) -> int:
    return sum(1 for c in table.chunks if c.gpu is not None or c.cpu is not None)
