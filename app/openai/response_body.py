"""The body of POST /v1/responses (`ResponseBody`) and what a turn reads from it: its input
items, sampling, structured output (`text.format`) and tool choice."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from app.http import MAX_SYSTEM_PROMPT
from app.openai import items as it
from app.openai.access import check_metadata
from app.openai.errors import ApiError
from app.openai.retention import RetentionField, RetentionName
from app.openai.tools import FunctionDef, NamedChoice, ToolChoice, checked, forcing_guide
from engine.types import Guide, SamplingParams


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = Field(None, max_length=64)
    schema_: Any = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None


class ConversationRef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str


class ResponseBody(BaseModel):
    """The body of POST /v1/responses; fields the server does not use are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str
    input: Any = None  # a string or a list of items: read by items.parse_items
    instructions: str | None = Field(None, max_length=MAX_SYSTEM_PROMPT)
    previous_response_id: str | None = Field(None, min_length=1, max_length=64)
    conversation: str | ConversationRef | None = None
    store: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    stream: bool | None = False
    metadata: dict[str, str] | None = None
    text: TextConfig | None = None
    tools: list[dict] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    user: str | None = Field(None, max_length=256)
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=200)  # routing only
    prompt_cache_retention: RetentionName | None = None
    retention: RetentionField | None = None  # extension: a pin and a priority

    def functions(self) -> list[FunctionDef]:
        """The function tools, checked against the tool choice (ApiError if they are not)."""
        out = []
        for i, t in enumerate(self.tools or []):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else None
                raise ApiError(400, f"tools.{i}: only function tools are supported, not "
                               f"{kind!r:.40}", param=f"tools.{i}")  # fmt: skip
            try:
                out.append(FunctionDef.model_validate(t))
            except ValidationError as e:
                err = e.errors(include_url=False)[0]
                where = ".".join(str(p) for p in (f"tools.{i}", *err["loc"]))
                raise ApiError(400, f"{where}: {err['msg']}", param=f"tools.{i}") from None
        return checked(out, self.tool_choice)

    def reads_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(value)

    @property
    def conversation_id(self) -> str | None:
        c = self.conversation
        return c.id if isinstance(c, ConversationRef) else c


def guide_of(body: ResponseBody) -> Guide | None:
    """`text.format` as the engine's constrained decoding."""
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Guide(kind="json_object")
    if not isinstance(fmt.schema_, dict):
        raise ApiError(400, "text.format: a json_schema format needs `schema`, a JSON object",
                       param="text.format")  # fmt: skip
    return Guide(kind="json_schema", source=json.dumps(fmt.schema_))


def tool_choice_of(body: ResponseBody):
    choice = body.tool_choice
    if isinstance(choice, NamedChoice):
        return {"type": "function", "name": choice.target()}
    return choice or "auto"


def format_of(body: ResponseBody) -> dict:
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type != "json_schema":
        return {"type": fmt.type if fmt else "text"}
    shown = {"type": "json_schema", "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
    return {**shown, "description": fmt.description} if fmt.description else shown


def sampling_of(
    body: ResponseBody, tools: list[FunctionDef], default: int, limit: int
) -> SamplingParams:
    given = body.max_output_tokens
    if given is not None and given > limit:
        raise ApiError(400, f"max_output_tokens: must be at most {limit}",
                       param="max_output_tokens")  # fmt: skip
    guide, forced = guide_of(body), forcing_guide(tools, body.tool_choice, body.parallel_tool_calls)
    if guide and forced:
        raise ApiError(400, "text.format cannot be combined with a tool_choice that forces "
                       "a call", param="text.format")  # fmt: skip
    return SamplingParams(
        max_tokens=given or default,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        guide=forced or guide,
    )


def entries_of(body: ResponseBody, max_chars: int) -> list[it.Entry]:
    if body.input is None or body.input == []:
        raise ApiError(400, "input: required (a string or a list of items)", param="input")
    entries = it.parse_items(body.input, max_chars)
    if entries[-1].role not in ("user", "tool"):
        raise ApiError(400, "input: the last item must be a user message or a "
                       "function_call_output", param="input")  # fmt: skip
    return entries
