"""A turn's retention: what it asks the cache to keep of its conversation, and what of that
is kept across restarts.

Asked, as every front takes it (the OpenAI API's request bodies, the chat socket's frames):
OpenAI's `prompt_cache_retention` ("in_memory", the default, or "24h": kept at least on the
disk tier for a day after the turn) and the extension `retention: {ttl_s, priority}` (pinned
in memory for `ttl_s` after each turn, its eviction value scaled by `priority`), as the
engine's `Retention`, counted against the owner's cap of pinned bytes.

Shared: a pin is counted against its owner's cap across the replicas of a cluster through
Redis (app/pin_caps.py), reserved before the engine takes its turn, what the engine holds
written when the turn ends.

Kept: what the engine's pins hold of a conversation (a pin until a wall time, counted
against its owner's cap; a priority; a finished session) is written to SQL when each of its
turns ends, and put back into the engine when the server starts. (The disk tier keeps its
own keeps, in its directory: engine/disk/keeps.py.) Durability only: a database that refuses a
write is logged, and the turn, whose reply is committed already, goes on; one that cannot be
read at start leaves the pins to their clients' next turns."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.cache.pins import Retained
from engine.types import MAX_TTL_S, Retention, Turn
from store import ConversationRetention

if TYPE_CHECKING:  # the engine's front loads torch
    from app.pin_caps import PinCaps
    from engine import AsyncEngine
    from store import HistoryStore

log = logging.getLogger("pensieve.retention")

DAY_S = 86_400.0
# OpenAI spells it both ways in its documents
RetentionName = Literal["in_memory", "in-memory", "24h"]


# --- what a turn asks ---------------------------------------------------------------------
class RetentionField(BaseModel):
    """The extension `retention`: `ttl_s` pins the conversation in memory that long after
    each turn (0: the session is done, its chunks go first); `priority` 0-100 (50 neutral)."""

    model_config = ConfigDict(extra="forbid")
    ttl_s: float | None = Field(None, ge=0.0, le=MAX_TTL_S, allow_inf_nan=False)
    priority: int = Field(50, ge=0, le=100)


class NoDiskTier(ValueError):
    """A 24h retention asked of a server without a disk tier."""


def retention_of(
    owner_id: str,
    name: str | None,
    ext: RetentionField | None,
    disk_tier: bool,
    cap_mb: float,
) -> Retention | None:
    """The engine's retention for a turn's fields (None: nothing asked), `cap_mb` the
    owner's cap of pinned memory; NoDiskTier for a 24h retention where the server has no
    disk tier."""
    disk = name == "24h"
    if disk and not disk_tier:
        raise NoDiskTier("prompt_cache_retention: '24h' keeps a conversation's KV on the disk "
                         "tier, and this server has none (disk_cache_dir is unset); use "
                         "'in_memory'")  # fmt: skip
    if not disk and ext is None:
        return None
    return Retention(
        ttl_s=ext.ttl_s if ext else None,
        priority=ext.priority if ext else 50,
        disk_s=DAY_S if disk else 0.0,
        owner=owner_id,
        cap_bytes=round(cap_mb * 2**20),
    )


# --- what the replicas count together ------------------------------------------------------
async def reserve_shared(caps: PinCaps, engine: AsyncEngine, turn: Turn) -> str | None:
    """Reserve the turn's pin against its owner's cap across the replicas (sized as the
    engine sizes it: for the context the turn may reach); the refusal's message, or None."""
    r = turn.retention
    if r is None or not r.ttl_s or r.cap_bytes is None:
        return None
    size = engine.pin_bytes(
        (turn.context_len or 0) + len(turn.prompt_token_ids) + turn.sampling.max_tokens
    )
    used = await caps.reserve(r.owner, turn.conversation_id, size, r.ttl_s, r.cap_bytes)
    if used is None:
        return None
    return (f"retention: pinning this conversation ({size} bytes at most) would take this "
            f"owner's pinned KV on all replicas to {used + size} bytes, over the cap of "
            f"{r.cap_bytes} bytes; let other sessions go (ttl_s 0) or pin less")  # fmt: skip


async def share(
    caps: PinCaps, engine: AsyncEngine, conversation_id: str, asked: Retention | None
) -> None:
    """Tell the other replicas what this engine's pin of the conversation holds now (after
    its turn, or a refusal that left an earlier pin or none)."""
    kept = engine.retained(conversation_id)
    if kept is not None and kept.ttl_s is not None:
        await caps.hold(kept.owner, conversation_id, kept.bytes, kept.until)
    elif asked is not None:
        await caps.forget(asked.owner, conversation_id)


# --- what is kept across restarts (`replica`: whose engine holds the pins, this replica's
# id in a cluster, None for a lone server) -------------------------------------------------
async def save(
    engine: AsyncEngine,
    store: HistoryStore,
    replica: str | None,
    conversation_id: str,
    asked: bool,
) -> None:
    """A turn of the conversation ended (`asked`: it carried a retention): store what its
    retention holds now (a pin's until moves with every turn). Never raises."""
    kept = engine.retained(conversation_id)
    if kept is None and not asked:  # nothing held and nothing changed: no write
        return
    try:
        if kept is None:
            await store.clear_retention(conversation_id)
        else:
            await store.save_retention(_row(kept, replica))
    except Exception as e:  # the reply is committed: only the durability is lost
        log.warning("could not store the retention of %s: %r", conversation_id, e)


async def clear(store: HistoryStore, conversation_id: str) -> None:
    """Its pin was let go (its response deleted): forget it in SQL too. Never raises."""
    try:
        await store.clear_retention(conversation_id)
    except Exception as e:
        log.warning("could not clear the retention of %s: %r", conversation_id, e)


async def restore(engine: AsyncEngine, store: HistoryStore, replica: str | None) -> int:
    """At start: put back into the engine the retention stored by this server (or replica)
    that still holds something. Returns the pins put back."""
    try:
        rows = await store.live_retention(replica, datetime.now(UTC))
    except Exception as e:
        log.warning("could not read the stored retention; pins come back with new turns: %r", e)
        return 0
    pinned = engine.restore_retention([_kept(r) for r in rows])
    if rows:
        log.info("retention: %d pins of %d conversations put back", pinned, len(rows))
    return pinned


def _row(kept: Retained, replica: str | None) -> ConversationRetention:
    pinned = kept.ttl_s is not None
    return ConversationRetention(
        conversation_id=kept.conversation_id,
        owner_id=kept.owner,
        replica=replica,
        ttl_s=kept.ttl_s,
        pinned_until=datetime.fromtimestamp(kept.until, UTC) if pinned else None,
        pinned_bytes=kept.bytes,
        priority=kept.priority,
        done=kept.done,
        updated=datetime.now(UTC),
    )


def _kept(row: ConversationRetention) -> Retained:
    until = row.pinned_until.timestamp() if row.pinned_until is not None else 0.0
    return Retained(
        row.conversation_id,
        row.owner_id,
        row.ttl_s,
        until,
        row.pinned_bytes,
        row.priority,
        row.done,
    )
