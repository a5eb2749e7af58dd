"""Retention on the OpenAI API (`app/turns/retention.py`): a 24h retention without a disk tier is
a 400 naming `prompt_cache_retention`."""

from __future__ import annotations

from app.openai.errors import ApiError
from app.services import Services
from app.turns import retention
from app.turns.retention import RetentionField, RetentionName
from engine.types import Retention

__all__ = ["RetentionField", "RetentionName", "retention_of"]


def retention_of(
    sv: Services, owner_id: str, name: str | None, ext: RetentionField | None
) -> Retention | None:
    """`app.turns.retention.retention_of`, its refusal as the API's 400."""
    try:
        return retention.retention_of(
            owner_id, name, ext, sv.engine.disk_tier, sv.settings.max_pinned_mb_per_owner
        )
    except retention.NoDiskTier as e:
        raise ApiError(400, str(e), param="prompt_cache_retention") from None
