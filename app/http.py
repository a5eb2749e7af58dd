"""What every HTTP handler shares: refusals (`BadRequest`, `problem`), bounded JSON bodies
checked by a pydantic model, the request's owner, and the limits on stored text."""

from __future__ import annotations

from typing import Annotated, TypeVar

from pydantic import AfterValidator, BaseModel, StringConstraints, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from app.auth import owner_token
from app.services import services

M = TypeVar("M", bound="BaseModel")
MAX_SYSTEM_PROMPT = 16_000


class BadRequest(Exception):
    """A request refused before it reaches the store: its status, code and message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def problem(status: int, code: str, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": code, "message": message}, status_code=status, headers=headers)


def _storable(text: str) -> str:
    # PostgreSQL text holds neither NUL nor unpaired surrogates (which UTF-8 cannot encode).
    if "\x00" in text:
        raise ValueError("must not contain NUL characters")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must not contain unpaired surrogate characters") from None
    return text


def Text(max_length: int):  # noqa: N802 - reads as a type
    """A string PostgreSQL can store, of at most `max_length` characters."""
    return Annotated[str, StringConstraints(max_length=max_length), AfterValidator(_storable)]


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes `limit` bytes: a large body is
    never held whole, and the rest of it is never read."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(413, "too_large", f"the body must be at most {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(413, "too_large", f"the body must be at most {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(request: Request, model: type[M]) -> M:
    """A JSON body validated by `model`; an empty body is `{}`."""
    raw = await read_body(request, request.app.state.settings.max_body_bytes)
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if raw.strip() and media_type != "application/json":
        raise BadRequest(415, "bad_content_type", "send the body as Content-Type: application/json")
    try:
        return model.model_validate_json(raw) if raw.strip() else model.model_validate({})
    except ValidationError as e:
        raise BadRequest(400, "bad_request", _describe(e)) from None


def _describe(e: ValidationError) -> str:
    parts = []
    for err in e.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"])
        if err["type"] == "json_invalid":
            parts.append(f"the body is not valid JSON ({err['ctx'].get('error', 'invalid')})")
        elif err["type"] == "model_type" or err["type"] == "model_attributes_type":
            parts.append("the body must be a JSON object")
        elif err["type"] == "extra_forbidden":
            parts.append(f"unknown field: {where}")
        else:
            parts.append(f"{where}: {err['msg']}" if where else err["msg"])
    return "; ".join(parts)


async def current_user(request: Request):
    """The owner the request proves it is (its bearer token or cookie); None without one."""
    token = owner_token(request)
    return await services(request).store.user_by_token(token) if token else None
