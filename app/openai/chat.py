"""The OpenAI Chat Completions API under /v1, over the same stateful conversations as the
chat socket.

A client resends the whole chat each turn; the request continues the owner's conversation
that stores the longest prefix of it (app/turns/matching.py), or the one its `X-Session-ID`
header / `prompt_cache_key` names. A history the client edited or cut cuts the conversation
back to the common prefix first. The turn itself is the chat socket's (app/turns/pipeline.py), so a
/v1 turn is stored exactly like a socket turn."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.cluster import handoff
from app.openai.access import body_of, check_model, model_id, owner
from app.openai.errors import UNAVAILABLE, ApiError, pipeline_error
from app.openai.formats import guide_of
from app.openai.retention import RetentionField, RetentionName, retention_of
from app.openai.serving import (
    TITLE_CHARS,
    ApiSink,
    Failed,
    check_quota,
    refusal,
    start,
    take_turn,
    usage,
)
from app.openai.tools import ToolChoice, ToolDef, checked, forcing_guide, wire
from app.services import Services, services
from app.turns import matching, toolcalls
from app.turns.pipeline import DB_ERRORS, ChatTurn, Done
from app.turns.request import TurnRequest, check_text
from app.turns.toolcalls import Call, reply_text
from engine.types import SamplingParams

# --- the request -----------------------------------------------------------------------


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class WireFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class WireCall(BaseModel):
    """A call in an assistant message the client sends back."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: WireFunction

    def call(self) -> Call:
        try:
            args = json.loads(self.function.arguments or "{}")
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise ValueError(
                f"the arguments of the call to {self.function.name!r} are not a JSON object"
            )
        return Call(self.function.name, args)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[WireCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool result's

    def text(self) -> str:
        """The message as the conversation stores it (calls in their text format)."""
        if isinstance(self.content, list):
            content = "\n".join(p.text for p in self.content)
        else:
            content = self.content or ""
        if self.tool_calls:
            return reply_text(content or None, [c.call() for c in self.tool_calls])
        return content


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class CompletionBody(BaseModel):
    """The body of POST /v1/chat/completions; fields the server does not use are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extension; -1 or 0: off
    ignore_eos: bool = False  # vLLM's extension, for benchmarks
    min_tokens: int = Field(0, ge=0)  # vLLM's extension: no stop before this many tokens
    response_format: dict | None = None  # structured output (app/openai/formats.py)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    n: int | None = Field(None, ge=1, le=1)
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=200)
    session_id: str | None = Field(None, min_length=1, max_length=200)  # vLLM's, Dynamo's
    prompt_cache_retention: RetentionName | None = None
    retention: RetentionField | None = None  # extension: a pin and a priority
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("up to 4 non-empty strings")
        return stops


def parse(raw: bytes) -> CompletionBody:
    try:
        return CompletionBody.model_validate_json(raw)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        if err["type"] == "json_invalid":
            raise ApiError(400, "the body is not valid JSON") from None
        msg = "n: only n=1 is supported" if param == "n" else f"{param}: {err['msg']}"
        raise ApiError(400, msg, param=param) from None


def tools_of(body: CompletionBody) -> list:
    """The request's functions, checked against its tool_choice."""
    return checked([t.function for t in body.tools or []], body.tool_choice)


@dataclass
class Chat:
    """A request's chat: system prompt, then (role, text) messages ending with the user's."""

    system: str | None
    messages: list[tuple[str, str]]


def chat_of(body: CompletionBody, max_chars: int) -> Chat:
    try:
        msgs = [("system" if m.role == "developer" else m.role, m.text()) for m in body.messages]
    except ValueError as e:
        raise ApiError(400, f"messages: {e}", param="messages") from None
    for i, (_, text) in enumerate(msgs):
        problem = check_text(text)
        if problem or len(text) > max_chars:
            why = problem or f"has {len(text)} characters, the limit is {max_chars}"
            raise ApiError(400, f"messages[{i}].content {why}", param=f"messages.{i}.content")
    system = None
    if msgs and msgs[0][0] == "system":
        system, msgs = msgs[0][1] or None, msgs[1:]
    if not msgs or msgs[-1][0] not in ("user", "tool"):
        raise ApiError(400, "messages must end with a user message or a tool's result",
                       param="messages")  # fmt: skip
    return Chat(system, msgs)


def sampling_of(body: CompletionBody, default: int, limit: int) -> tuple[SamplingParams, bool]:
    given = body.max_completion_tokens or body.max_tokens
    if given is not None and given > limit:
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        raise ApiError(400, f"{param}: must be at most {limit}", param=param)
    sampling = SamplingParams(
        max_tokens=given or default,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(0, body.top_k or 0),
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        guide=guide_of(body.response_format),
    )
    if sampling.min_tokens > sampling.max_tokens:
        raise ApiError(400, "min_tokens: must be at most max_tokens", param="min_tokens")
    return sampling, given is not None


# --- which conversation ----------------------------------------------------------------


async def bound_conversation(
    sv: Services, owner_id: str, chat: Chat, session: str | None
) -> str | None:
    """The owner's conversation the request continues: the one its session names, else
    (no session) the stored chat it extends; None: a new chat."""
    store = sv.store
    if not session:
        return await matching.find_conversation(store, owner_id, chat.system, chat.messages)
    conv = await store.conversation_by_key(owner_id, session)
    conv = conv or await store.get_conversation(session, owner_id)
    return None if conv is None else conv.id


def session_of(request: Request, body: CompletionBody) -> str | None:
    """The session a request names: vLLM's and Dynamo's header or body field, or OpenAI's
    prompt_cache_key."""
    return request.headers.get("x-session-id") or body.session_id or body.prompt_cache_key


async def conversation_for(
    sv: Services, owner_id: str, chat: Chat, session: str | None
) -> tuple[str, bool]:
    """The conversation the request continues (and False), or a new one (and True)."""
    store = sv.store
    cid = await bound_conversation(sv, owner_id, chat, session)
    if cid is not None:
        return cid, False
    await check_quota(sv, owner_id)
    first = chat.messages[0][1] if chat.messages else ""
    title = " ".join(first.split())[:TITLE_CHARS]
    conv = await store.create_conversation(owner_id, title, chat.system, session_key=session)
    return conv.id, True


def aligner(sv: Services, cid: str, chat: Chat, req: TurnRequest):
    """Run under the chat's lock before its turn: cut the stored chat back to what the
    request shares with it, and queue the request's other new messages ahead of its last."""

    async def align() -> bool:
        store = sv.store
        conv = await store.get_conversation(cid)
        if conv is None:
            return True  # the turn answers not_found
        stored = [(m.role, toolcalls.as_sent(m.role, m.content)) for m in await store.messages(cid)]
        keep = matching.common_turns(conv.system_prompt, stored, chat.system, chat.messages)
        edited = keep < len(stored) or (conv.system_prompt or None) != chat.system
        # The engine's copy of a removed window is of no use; within the window the turn's
        # context_len cuts the engine's copy back.
        if edited and await store.rewind(cid, keep, chat.system):
            await sv.engine.free(cid)
        req.before = chat.messages[keep:-1]
        return True

    return align


async def discard_if_empty(sv: Services, cid: str) -> None:
    with contextlib.suppress(*DB_ERRORS):  # a chat left empty is harmless
        async with sv.hub.lock(cid):
            if not await sv.store.messages(cid):
                await sv.store.delete_conversation(cid)


def finish_reason(done: Done, calls: int = 0) -> str:
    if calls:
        return "tool_calls"
    return "length" if done.out.finish_reason == "length" else "stop"


# --- endpoints ---------------------------------------------------------------------------


async def chat_completions(request: Request) -> Response:
    t0 = time.perf_counter()
    sv = services(request)
    try:
        user = await owner(request)
        raw = await body_of(request, sv)
        body = parse(raw)
        check_model(sv, body.model)
        chat = chat_of(body, sv.settings.max_message_chars)
        st = sv.settings
        sampling, given = sampling_of(body, st.max_tokens_default, st.max_tokens_limit)
        tools = tools_of(body)
        forced = forcing_guide(tools, body.tool_choice, body.parallel_tool_calls)
        if forced and sampling.guide:
            raise ApiError(400, "response_format cannot be combined with a tool_choice that "
                           "forces a call", param="response_format")  # fmt: skip
        sampling.guide = forced or sampling.guide
        keep = retention_of(sv, user.id, body.prompt_cache_retention, body.retention)
        await take_turn(request, sv, user.id)
        cid, created = await conversation_for(sv, user.id, chat, session_of(request, body))
        relayed = await handoff.forward_turn(request, raw, cid)  # claims a new one here
        if relayed is not None:  # the conversation's home replica answers
            return relayed
    except ApiError as e:
        return e.response()
    except DB_ERRORS:
        return UNAVAILABLE.response()

    role, content = chat.messages[-1]
    specs = [f.spec() for f in tools] or None
    req = TurnRequest(content, sampling, given, role=role, tools=specs, retention=keep)
    sink = ApiSink(body.stop or [], calls=bool(tools) and body.tool_choice != "none")
    turn = ChatTurn(sv.turn_deps(), cid, sink).run(req, t0, aligner(sv, cid, chat, req))
    task, first = await start(sv, turn, sink)
    refused = refusal(first)
    if refused is not None:
        if created and isinstance(first, Failed):  # refused before anything was stored
            await asyncio.wait([task])
            await discard_if_empty(sv, cid)  # leave no empty chat behind
        return refused
    reply = Reply(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model_id(sv.settings))
    headers = {"X-Session-ID": cid}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = reply.sse(first, sink, include_usage)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    return await reply.whole(first, sink, headers, sink.calls is not None)


@dataclass
class Reply:
    id: str
    created: int
    model: str

    def _chunk(self, delta: dict, finish: str | None, usage_field: bool) -> dict:
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if usage_field:
            chunk["usage"] = None
        return chunk

    async def sse(self, first, sink: ApiSink, include_usage: bool):
        """Server-sent events: a role chunk, content chunks, the finish chunk, the usage
        chunk when asked for, [DONE]. A client that leaves cancels the turn."""

        def data(obj) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        ended, calls = False, 0
        try:
            yield data(self._chunk({"role": "assistant", "content": ""}, None, include_usage))
            event = first
            while True:
                if isinstance(event, str):
                    yield data(self._chunk({"content": event}, None, include_usage))
                elif isinstance(event, Call):
                    delta = {"tool_calls": [wire(event, calls)]}
                    yield data(self._chunk(delta, None, include_usage))
                    calls += 1
                elif isinstance(event, Done):
                    yield data(self._chunk({}, finish_reason(event, calls), include_usage))
                    if include_usage:
                        yield data({**self._chunk({}, None, False), "choices": [],
                                    "usage": usage(event)})  # fmt: skip
                    yield "data: [DONE]\n\n"
                    break
                elif isinstance(event, Failed):
                    err = pipeline_error(event.code, event.message, event.retry_after_s)
                    yield data(err.body())
                    break
                else:  # END without an outcome
                    yield data(ApiError(500, "the turn failed", "server_error").body())
                    break
                event = await sink.events.get()
            ended = True
        finally:
            if not ended:
                sink.gone()

    async def whole(self, first, sink: ApiSink, headers: dict, tools: bool) -> Response:
        pieces, event = [], first
        while isinstance(event, (str, Call)):
            pieces.append(event)
            event = await sink.events.get()
        if isinstance(event, Failed):
            return pipeline_error(event.code, event.message, event.retry_after_s).response()
        if not isinstance(event, Done):
            return ApiError(500, "the turn failed", "server_error").response()
        content, calls = toolcalls.parse(event.out.text) if tools else (event.out.text, [])
        message = {"role": "assistant", "content": content, "refusal": None}
        if calls:
            message["tool_calls"] = [wire(c) for c in calls]
        body = {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": finish_reason(event, len(calls)),
                }  # fmt: skip
            ],
            "usage": usage(event),
        }
        return JSONResponse(body, headers=headers)


routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"])]
