"""Validation of the chat socket's client frames; every refusal names the field."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from app.turns.request import TurnRequest, check_text
from app.turns.retention import RetentionField, RetentionName
from engine.types import SamplingParams


class BadFrame(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def parse_json(text: str) -> dict:
    """A frame's JSON object; deep nesting is bad JSON too, not a crash."""
    try:
        frame = json.loads(text)
    except (ValueError, RecursionError):
        raise BadFrame("bad_json", "frames must be JSON objects") from None
    if not isinstance(frame, dict):
        raise BadFrame("bad_json", "frames must be JSON objects")
    return frame


class SamplingFrame(BaseModel):
    """The sampling fields a frame that starts a turn may carry; limits from the settings
    come in the validation context."""

    model_config = ConfigDict(strict=True, extra="ignore")

    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    # what the cache keeps of the chat after the turn, as on the OpenAI API (app/turns/retention.py)
    prompt_cache_retention: RetentionName | None = None
    retention: RetentionField | None = None

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, value: int | None, info: ValidationInfo) -> int | None:
        limit = info.context["max_tokens"]
        if value is not None and value > limit:
            raise PydanticCustomError("bad_sampling", "must be at most {limit}", {"limit": limit})
        return value


class RegenerateFrame(SamplingFrame):
    """`{"type": "regenerate", sampling...}`: answer the last message again."""

    type: Literal["regenerate"] = "regenerate"


class MessageFrame(SamplingFrame):
    """`{"type": "message", "content": ..., "max_tokens"?, "temperature"?, "top_p"?, "seed"?}`."""

    type: Literal["message"] = "message"
    content: str

    @field_validator("content")
    @classmethod
    def _content(cls, value: str, info: ValidationInfo) -> str:
        if not value.strip():
            raise PydanticCustomError("bad_content", "must not be blank")
        problem = check_text(value)
        if problem:
            raise PydanticCustomError("bad_content", problem)
        limit = info.context["max_chars"]
        if len(value) > limit:
            raise PydanticCustomError(
                "too_long",
                "has {n} characters, the limit is {limit}",
                {"n": len(value), "limit": limit},
            )
        return value


class EditFrame(MessageFrame):
    """`{"type": "edit", "seq": N, "content": ..., sampling...}`: replace the user's message
    `seq` (and everything after it) with `content`, and answer it."""

    type: Literal["edit"] = "edit"
    seq: int = Field(ge=0, le=2**31 - 1)


def _refusal(e: ValidationError) -> BadFrame:
    err = e.errors(include_url=False)[0]
    field = ".".join(map(str, err["loc"])) or "frame"
    if field == "content":
        code = "too_long" if err["type"] == "too_long" else "bad_content"
    elif field == "seq":
        code = "bad_seq"
    elif field.split(".")[0] in ("retention", "prompt_cache_retention"):
        code = "bad_retention"
    else:
        code = "bad_sampling"
    shown = "" if field == "content" or err["type"] == "missing" else f", got {err['input']!r:.40}"
    return BadFrame(code, f"{field}: {err['msg']}{shown}")


def _validate(model: type[SamplingFrame], frame: dict, max_chars: int, limit_tokens: int):
    try:
        return model.model_validate(
            frame, context={"max_chars": max_chars, "max_tokens": limit_tokens}
        )
    except ValidationError as e:
        raise _refusal(e) from None


def _request(m: SamplingFrame, content: str, default_tokens: int) -> TurnRequest:
    sampling = SamplingParams(
        max_tokens=m.max_tokens or default_tokens,
        temperature=0.0 if m.temperature is None else m.temperature,
        top_p=1.0 if m.top_p is None else m.top_p,
        seed=m.seed,
    )
    asked = (m.prompt_cache_retention, m.retention)
    return TurnRequest(content, sampling, m.max_tokens is not None, asked=asked)


def parse_message(
    frame: dict, max_chars: int, default_tokens: int, limit_tokens: int
) -> TurnRequest:
    """Validate a `message` frame into the turn's request."""
    m = _validate(MessageFrame, frame, max_chars, limit_tokens)
    return _request(m, m.content, default_tokens)


def parse_edit(
    frame: dict, max_chars: int, default_tokens: int, limit_tokens: int
) -> tuple[int, TurnRequest]:
    """Validate an `edit` frame: the seq of the message it replaces, and the turn's request.
    Whether that seq names a message of the user is checked against the stored chat."""
    m = _validate(EditFrame, frame, max_chars, limit_tokens)
    return m.seq, _request(m, m.content, default_tokens)


def parse_regenerate(frame: dict, default_tokens: int, limit_tokens: int) -> TurnRequest:
    """Validate a `regenerate` frame; the request's content is the stored last question."""
    m = _validate(RegenerateFrame, frame, 1, limit_tokens)
    return _request(m, "", default_tokens)
