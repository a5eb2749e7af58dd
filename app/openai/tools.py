"""Function tools in the /v1 API: the request's `tools` and `tool_choice`, the grammar that
forces a call when the choice demands one, and the calls read out of a reply, whole or as
it streams. The calls' text format is app/turns/toolcalls.py's."""

from __future__ import annotations

import json
import uuid
from typing import Literal

from jsonschema import SchemaError
from jsonschema.validators import validator_for
from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.openai.errors import ApiError
from app.turns.toolcalls import OPEN, Call, parse
from engine.types import Guide

CLOSE = "</tool_call>"
# Calls are written as json.dumps writes them, so a forced call is already canonical.
SEPARATORS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(None, max_length=4096)
    parameters: dict | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema(cls, value: dict | None) -> dict | None:
        if value is None:
            return value
        if value.get("type", "object") != "object":
            raise ValueError("a function's parameters must be a JSON schema of an object")
        try:
            validator_for(value).check_schema(value)
        except SchemaError as e:
            raise ValueError(f"not a valid JSON schema: {e.message}") from None
        return value

    @property
    def arguments_schema(self) -> dict:
        """Its arguments' schema: a function without parameters takes none."""
        return self.parameters or {
            "type": "object",
            "properties": {},
            "additionalProperties": False,
        }

    def spec(self) -> dict:
        """As the chat template (or the fallback's <tools> list) shows it to the model."""
        out: dict = {"name": self.name}
        if self.description:
            out["description"] = self.description
        out["parameters"] = self.arguments_schema
        return {"type": "function", "function": out}


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedChoice(BaseModel):
    """`{"type": "function", "function": {"name": ...}}` (Chat Completions) or
    `{"type": "function", "name": ...}` (Responses)."""

    type: Literal["function"]
    function: NamedFunction | None = None
    name: str | None = None

    def target(self) -> str:
        name = self.function.name if self.function else self.name
        if not name:
            raise ValueError("a named tool_choice needs the function's name")
        return name


ToolChoice = Literal["auto", "none", "required"] | NamedChoice


def check(tools: list[FunctionDef], choice: ToolChoice | None) -> None:
    """Names unique; a named or required choice has something to call. ValueError if not."""
    names = [f.name for f in tools]
    if len(set(names)) != len(names):
        raise ValueError("tools: function names must be unique")
    if isinstance(choice, NamedChoice) and choice.target() not in names:
        raise ValueError(f"tool_choice: no tool is named {choice.target()!r}")
    if choice == "required" and not tools:
        raise ValueError("tool_choice: 'required' needs tools")


def checked(tools: list[FunctionDef], choice: ToolChoice | None) -> list[FunctionDef]:
    """`check` as the API answers it: a 400 naming tools or tool_choice."""
    try:
        check(tools, choice)
    except ValueError as e:
        param = "tool_choice" if str(e).startswith("tool_choice") else "tools"
        raise ApiError(400, str(e), param=param) from None
    return tools


def forcing_guide(
    tools: list[FunctionDef], choice: ToolChoice | None, parallel: bool
) -> Guide | None:
    """The grammar a reply must follow when the choice demands a call: one call (or, for
    `required` with parallel calls, one or more) of the allowed functions, nothing else."""
    if isinstance(choice, NamedChoice):
        allowed, many = [f for f in tools if f.name == choice.target()], False
    elif choice == "required":
        allowed, many = tools, parallel
    else:
        return None
    schema = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f.name},
                    "arguments": f.arguments_schema,
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in allowed
        ],
        "x-guidance": SEPARATORS,
    }
    repeat = ' ("\\n" call)*' if many else ""
    lark = f'start: call{repeat}\ncall: "{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"\n'
    return Guide("lark", lark)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def wire(call: Call, index: int | None = None) -> dict:
    """A call as Chat Completions writes it (arguments as a JSON string)."""
    out = {
        "id": call_id(),
        "type": "function",
        "function": {
            "name": call.name,
            "arguments": json.dumps(call.arguments, ensure_ascii=False),
        },
    }
    return out if index is None else {"index": index, **out}


class CallStream:
    """Splits a streamed reply into content pieces and whole calls: text that may begin a
    call is held until it is one (or is not), a call is passed on once its block closes."""

    def __init__(self) -> None:
        self.held = ""
        self.in_call = False
        self.calls = 0

    def push(self, text: str) -> list[str | Call]:
        self.held += text
        out: list[str | Call] = []
        while True:
            if self.in_call:
                end = self.held.find(CLOSE)
                if end < 0:
                    return out
                block, self.held = self.held[: end + len(CLOSE)], self.held[end + len(CLOSE) :]
                self.in_call = False
                _, calls = parse(block)
                if calls:
                    self.calls += 1
                    out.append(calls[0])
                else:
                    out.append(block)  # not a call after all: it is text
                continue
            start = self.held.find(OPEN)
            if start >= 0:
                self._text(out, self.held[:start])
                self.held, self.in_call = self.held[start:], True
                continue
            keep = next((k for k in range(len(OPEN) - 1, 0, -1) if self.held.endswith(OPEN[:k])), 0)
            cut = len(self.held) - keep
            self._text(out, self.held[:cut])
            self.held = self.held[cut:]
            return out

    def flush(self) -> list[str | Call]:
        out: list[str | Call] = []
        self._text(out, self.held)
        self.held, self.in_call = "", False
        return out

    def _text(self, out: list, text: str) -> None:
        # after a call only real text counts: the newlines between blocks are format
        if text and not (self.calls and not text.strip()):
            out.append(text)
