"""Who asks, for which model, with what body: the checks every /v1 endpoint starts with."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from app.auth import bearer
from app.http import BadRequest, read_body
from app.openai.errors import ApiError
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


def validate(model: type[BaseModel], raw: bytes):
    """A JSON body validated by `model`; a refusal names the field."""
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        if err["type"] == "json_invalid":
            raise ApiError(400, "the body is not valid JSON") from None
        raise ApiError(
            400, f"{param}: {err['msg']}" if param else err["msg"], param=param
        ) from None


def check_metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512."""
    if value is not None and (
        len(value) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in value.items())
    ):
        raise ValueError("at most 16 pairs, keys of up to 64 and values of up to 512 characters")
    return value


def not_found(what: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"no {what} with that id", param=param, code="not_found")
