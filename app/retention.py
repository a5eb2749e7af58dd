"""What a turn asks the cache to keep of its conversation, as every front takes it (the
OpenAI API's request bodies, the chat socket's frames): OpenAI's `prompt_cache_retention`
("in_memory", the default, or "24h": kept at least on the disk tier for a day after the
turn) and the extension `retention: {ttl_s, priority}` (pinned in memory for `ttl_s` after
each turn, its eviction value scaled by `priority`), as the engine's `Retention`, counted
against the owner's cap of pinned bytes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.types import MAX_TTL_S, Retention

if TYPE_CHECKING:
    from app.services import Services

DAY_S = 86_400.0
# OpenAI spells it both ways in its documents
RetentionName = Literal["in_memory", "in-memory", "24h"]


class RetentionField(BaseModel):
    """The extension `retention`: `ttl_s` pins the conversation in memory that long after
    each turn (0: the session is done, its chunks go first); `priority` 0-100 (50 neutral)."""

    model_config = ConfigDict(extra="forbid")
    ttl_s: float | None = Field(None, ge=0.0, le=MAX_TTL_S, allow_inf_nan=False)
    priority: int = Field(50, ge=0, le=100)


class NoDiskTier(ValueError):
    """A 24h retention asked of a server without a disk tier."""


def retention_of(
    sv: Services, owner_id: str, name: str | None, ext: RetentionField | None
) -> Retention | None:
    """The engine's retention for a turn's fields (None: nothing asked); NoDiskTier for a
    24h retention where the server has no disk tier."""
    disk = name == "24h"
    if disk and not sv.engine.disk_tier:
        raise NoDiskTier("prompt_cache_retention: '24h' keeps a conversation's KV on the disk "
                         "tier, and this server has none (disk_cache_dir is unset); use "
                         "'in_memory'")  # fmt: skip
    if not disk and ext is None:
        return None
    cap = round(sv.settings.max_pinned_mb_per_owner * 2**20)
    return Retention(
        ttl_s=ext.ttl_s if ext else None,
        priority=ext.priority if ext else 50,
        disk_s=DAY_S if disk else 0.0,
        owner=owner_id,
        cap_bytes=cap,
    )
