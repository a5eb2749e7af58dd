"""Structured output: an OpenAI `response_format` as the engine's `Guide`.

`{"type": "text"}` (or none) is free text; `{"type": "json_object"}` any JSON object;
`{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` JSON valid for the
schema (the Responses API's flat `{"type": "json_schema", "name", "schema"}` is accepted too).
The schema is compiled and checked here, before a turn starts, so a bad one is a 400 and
nothing is stored."""

from __future__ import annotations

import json
import re

from app.openai.errors import ApiError
from engine.guide import check
from engine.types import Guide

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_SCHEMA_CHARS = 100_000


def _refuse(message: str, param: str = "response_format") -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def guide_of(response_format: object, param: str = "response_format") -> Guide | None:
    """The guide a `response_format` asks for; None for free text. ApiError (400, naming
    `param`) for anything malformed, or a schema the grammar compiler refuses."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise _refuse("must be an object", param)
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        guide = Guide("json_object")
    elif kind == "json_schema":
        spec = response_format.get("json_schema", response_format)
        if not isinstance(spec, dict):
            raise _refuse("json_schema must be an object", param)
        name = spec.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise _refuse("json_schema.name must be 1-64 letters, digits, '_' or '-'", param)
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise _refuse("json_schema.schema must be a JSON Schema object", param)
        source = json.dumps(schema)
        if len(source) > MAX_SCHEMA_CHARS:
            raise _refuse(f"json_schema.schema is over {MAX_SCHEMA_CHARS} characters", param)
        guide = Guide("json_schema", source)
    else:
        raise _refuse("type must be one of 'text', 'json_object', 'json_schema'", param)
    try:
        check(guide)
    except ValueError as e:
        raise _refuse(str(e), param) from None
    return guide
