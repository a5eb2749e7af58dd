"""A conversation's retention kept across restarts: what the engine's pins hold of it (a pin
until a wall time, counted against its owner's cap; a priority; a finished session) is
written to SQL when each of its turns ends, and put back into the engine when the server
starts. (The disk tier keeps its own keeps, in its directory: engine/keeps.py.)

Durability only: a database that refuses a write is logged, and the turn, whose reply is
committed already, goes on; one that cannot be read at start leaves the pins to their
clients' next turns."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from app.services import Services
from engine.cache.pins import Retained
from store import ConversationRetention

log = logging.getLogger("pensieve.retention")


def replica(sv: Services) -> str | None:
    """Whose engine holds the pins: this replica's id in a cluster, None for a lone server."""
    return sv.cluster.id if sv.cluster is not None else None


async def save(sv: Services, conversation_id: str, asked: bool) -> None:
    """A turn of the conversation ended (`asked`: it carried a retention): store what its
    retention holds now (a pin's until moves with every turn). Never raises."""
    kept = sv.engine.retained(conversation_id)
    if kept is None and not asked:  # nothing held and nothing changed: no write
        return
    try:
        if kept is None:
            await sv.store.clear_retention(conversation_id)
        else:
            await sv.store.save_retention(_row(kept, replica(sv)))
    except Exception as e:  # the reply is committed: only the durability is lost
        log.warning("could not store the retention of %s: %r", conversation_id, e)


async def clear(sv: Services, conversation_id: str) -> None:
    """Its pin was let go (its response deleted): forget it in SQL too. Never raises."""
    try:
        await sv.store.clear_retention(conversation_id)
    except Exception as e:
        log.warning("could not clear the retention of %s: %r", conversation_id, e)


async def restore(sv: Services) -> int:
    """At start: put back into the engine the retention stored by this server (or replica)
    that still holds something. Returns the pins put back."""
    try:
        rows = await sv.store.live_retention(replica(sv), datetime.now(UTC))
    except Exception as e:
        log.warning("could not read the stored retention; pins come back with new turns: %r", e)
        return 0
    pinned = sv.engine.restore_retention([_kept(r) for r in rows])
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
