"""Retention on the OpenAI API (`app/retention.py`): a 24h retention without a disk tier is
a 400 naming `prompt_cache_retention`."""

from __future__ import annotations

from app import retention
from app.openai.errors import ApiError
from app.retention import RetentionField, RetentionName
from app.services import Services
from engine.types import Retention

__all__ = ["RetentionField", "RetentionName", "retention_of"]


def retention_of(
    sv: Services, owner_id: str, name: str | None, ext: RetentionField | None
) -> Retention | None:
    """`app.retention.retention_of`, its refusal as the API's 400."""
    try:
        return retention.retention_of(sv, owner_id, name, ext)
    except retention.NoDiskTier as e:
        raise ApiError(400, str(e), param="prompt_cache_retention") from None
