"""Who asks, for which model, with what body: the checks every /v1 endpoint starts with."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request

from app.auth import bearer
from app.openai.errors import ApiError
from app.rest import BadRequest, read_body
from app.services import Services, services


def model_id(settings) -> str:
    return Path(settings.model.rstrip("/")).name or settings.model


async def owner(request: Request):
    token = bearer(request)
    user = await services(request).store.user_by_token(token) if token else None
    if user is None:
        raise ApiError(401, "invalid API key: send an owner's token as Authorization: Bearer <key>",
                       code="invalid_api_key")  # fmt: skip
    return user


async def body_of(request: Request, sv: Services) -> bytes:
    """The raw body, within the API's size limit."""
    try:
        return await read_body(request, sv.settings.max_api_body_bytes)
    except BadRequest as e:
        raise ApiError(e.status, e.message, code=e.code) from None


def check_model(sv: Services, name: str) -> None:
    if name != model_id(sv.settings):
        raise ApiError(404, f"the model {name!r:.80} does not exist; this server "
                       f"serves {model_id(sv.settings)!r}", param="model",
                       code="model_not_found")  # fmt: skip
