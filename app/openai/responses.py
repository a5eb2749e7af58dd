"""The OpenAI Responses API under /v1, over the same stateful conversations as the chat
socket.

A response names a point of a stored conversation: the reply it produced. A request that
chains to it (`previous_response_id`) while that reply is still its conversation's last
message continues the conversation, so only the new input is computed (the engine holds
the rest). Chaining to an earlier point, or a second time to the same one, forks: a new
conversation gets a copy of the history up to that reply (token ids included) and links
the parent's KV chunks (`AsyncEngine.fork`) instead of recomputing them. A request naming a
`conversation` (the Conversations API, app/openai/conversations.py) appends to it. With
`store: false` the response runs in a conversation of its own that is deleted once it is
answered. `instructions` are the system prompt of the response: a chained response whose
instructions differ from its conversation's forks (its context starts anew, the parent's
is not changed); a response in a named conversation sets that conversation's system
prompt. Every turn is the chat pipeline's (app/turns/pipeline.py), stored like any other.

Function tools (`tools`, `tool_choice`, `parallel_tool_calls`) work as in the Chat
Completions API (app/openai/tools.py): the reply's calls come out as `function_call`
items, and a `function_call_output` item sent back is the conversation's next message."""

from __future__ import annotations

import contextlib
import itertools
import json
import time
import uuid
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.cluster import handoff
from app.openai import items as it
from app.openai.access import (
    body_of,
    check_model,
    model_id,
    not_found,
    owner,
    validate,
)
from app.openai.errors import UNAVAILABLE, ApiError, pipeline_error
from app.openai.response_body import (
    ResponseBody,
    entries_of,
    format_of,
    sampling_of,
    tool_choice_of,
)
from app.openai.retention import retention_of
from app.openai.serving import (
    TITLE_CHARS,
    ApiSink,
    Failed,
    check_quota,
    drop,
    refusal,
    start,
    take_turn,
    usage,
)
from app.services import Services, services
from app.turns import retention
from app.turns.pipeline import DB_ERRORS, ChatTurn, Done
from app.turns.request import TurnRequest
from app.turns.toolcalls import Call
from store import ApiResponse

# --- the conversation a response runs in --------------------------------------------------


@dataclass
class Target:
    cid: str  # the conversation the turn runs in
    created: bool = False  # made for this response (a new chat or a fork)
    temporary: bool = False  # store=false: removed once answered
    expect_last: int | None = None  # continuing: the parent's reply is still the last message
    system: str | None = None  # a named conversation takes the instructions as its prompt
    set_system: bool = False
    linked: int = 0


async def fork(sv: Services, parent: ApiResponse, system: str | None, same: bool) -> str:
    """A new conversation holding the parent's history up to the parent response's reply;
    the engine links the parent's chunks of it when the parent's stream still starts with
    it (and the system prompt is the same). Run under the parent conversation's lock."""
    store = sv.store
    child = await store.fork_conversation(parent.conversation_id, parent.message_id, system)
    if child is None:
        raise not_found("response", "previous_response_id")
    if same:
        tokens = await store.stream(child.id)
        whole = await store.stream(parent.conversation_id)
        if tokens and whole[: len(tokens)] == tokens:
            # Refused (the engine loop is down): the child recomputes from SQL.
            with contextlib.suppress(ValueError, RuntimeError):
                await sv.engine.fork(parent.conversation_id, child.id, tokens, len(whole))
    return child.id


async def target_of(
    sv: Services, user, body: ResponseBody, entries: list[it.Entry], prev: ApiResponse | None
) -> Target:
    store, owner_id = sv.store, user.id
    if prev is not None:
        base = prev.conversation_id
        async with sv.hub.lock(base):
            conv = await store.get_conversation(base, owner_id)
            if conv is None or prev.message_id is None:
                raise not_found("response", "previous_response_id")
            same = (conv.system_prompt or None) == (body.instructions or None)
            last = await store.last_message_id(base)
            if last == prev.message_id and same and body.store:
                return Target(base, expect_last=last)
            await check_quota(sv, owner_id)
            child = await fork(sv, prev, body.instructions, same)
            return Target(child, created=True, temporary=not body.store)
    if body.conversation_id is not None:
        key = it.conversation_key(body.conversation_id)
        conv = key and await store.get_conversation(key, owner_id)
        if not conv:
            raise not_found("conversation", "conversation")
        changed = body.instructions is not None and body.instructions != conv.system_prompt
        return Target(conv.id, system=body.instructions, set_system=changed)
    await check_quota(sv, owner_id)
    first = next((e.text for e in entries if e.role == "user"), "")
    title = " ".join(first.split())[:TITLE_CHARS]
    conv = await store.create_conversation(owner_id, title, body.instructions or None)
    return Target(conv.id, created=True, temporary=not body.store)


def before_turn(sv: Services, target: Target, entries: list[it.Entry], req: TurnRequest, sink):
    """Run under the conversation's lock before its turn."""

    async def check() -> bool:
        store = sv.store
        last = target.expect_last
        if last is not None and await store.last_message_id(target.cid) != last:
            await sink.error("conflict", "the previous response was continued meanwhile; "
                             "send the request again (it then forks)")  # fmt: skip
            return False
        if target.set_system:
            n = len(await store.messages(target.cid))
            if await store.rewind(target.cid, n, target.system or None):
                await sv.engine.free(target.cid)
        req.before = [(e.stored_role, e.text) for e in entries[:-1]]
        return True

    return check


# --- the response object -----------------------------------------------------------------


@dataclass
class Shape:
    """What a response object says besides its outcome."""

    id: str
    created_at: int
    model: str
    body: ResponseBody
    reply_item_id: str = field(default_factory=it.new_item_id)

    def json(self, status: str, output: list, **extra) -> dict:
        b = self.body
        conv = b.conversation_id
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": extra.get("error"),
            "incomplete_details": extra.get("incomplete_details"),
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "conversation": {"id": conv} if conv else None,
            "reasoning": {"effort": None, "summary": None},
            "store": b.store,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "text": {"format": format_of(b)},
            "tool_choice": tool_choice_of(b),
            "tools": b.tools or [],
            "top_p": 1.0 if b.top_p is None else b.top_p,
            "truncation": "disabled",
            "usage": extra.get("usage"),
            "user": b.user,
            "metadata": b.metadata or {},
        }

    def output_item(self, text: str, status: str) -> dict:
        return it.message_item(self.reply_item_id, "assistant", text, status)

    def call_item(self, index: int, call) -> dict:
        return it.call_item(self.reply_item_id, index, call)

    def finished(self, done: Done) -> dict:
        u = usage(done)
        cut = done.out.finish_reason in ("length", "cancelled")
        status = "incomplete" if cut else "completed"
        incomplete = {"reason": "max_output_tokens"} if done.out.finish_reason == "length" else None
        return self.json(
            status,
            it.reply_items(self.reply_item_id, done.out.text, status, self.body.reads_calls()),
            incomplete_details=incomplete,
            usage={
                "input_tokens": u["prompt_tokens"],
                "input_tokens_details": {
                    "cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                    "cache_write_tokens": 0,
                },
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u["total_tokens"],
            },
        )


class ResponseSink(ApiSink):
    """The turn's sink that records the response (or drops a `store: false` one) before
    the client hears it is done, so a request chained to it right away finds it."""

    def __init__(self, record, calls: bool) -> None:
        super().__init__([], calls)
        self.record = record
        self.body: dict | None = None

    async def done(self, done: Done) -> None:
        try:
            self.body = await self.record(done)
        except DB_ERRORS:
            self.events.put_nowait(
                Failed(
                    "unavailable",
                    "the database is unavailable right now; the response "
                    "was not saved, try again shortly",
                )  # fmt: skip
            )
            return
        await super().done(done)


# --- endpoints ---------------------------------------------------------------------------


async def create_response(request: Request) -> Response:
    t0 = time.perf_counter()
    sv = services(request)
    st = sv.settings
    try:
        user = await owner(request)
        raw = await body_of(request, sv)
        body: ResponseBody = validate(ResponseBody, raw)
        check_model(sv, body.model)
        entries = entries_of(body, st.max_message_chars)
        tools = body.functions()
        sampling = sampling_of(body, tools, st.max_tokens_default, st.max_tokens_limit)
        if body.previous_response_id and body.conversation is not None:
            raise ApiError(400, "previous_response_id and conversation cannot both be given",
                           param="conversation")  # fmt: skip
        if not body.store and body.conversation is not None:
            raise ApiError(400, "store: false cannot add to a conversation", param="store")
        prev = None
        if body.previous_response_id:
            prev = await sv.store.get_response(body.previous_response_id, user.id)
            if prev is None:
                raise not_found("response", "previous_response_id")
        keep = retention_of(sv, user.id, body.prompt_cache_retention, body.retention)
        await take_turn(request, sv, user.id)
        base = prev.conversation_id if prev else it.conversation_key(body.conversation_id or "")
        if base:  # the home replica of the conversation it builds on answers
            relayed = await handoff.forward_turn(request, raw, base)
            if relayed is not None:
                return relayed
        target = await target_of(sv, user, body, entries, prev)
    except ApiError as e:
        return e.response()
    except DB_ERRORS:
        return UNAVAILABLE.response()

    shape = Shape(f"resp_{uuid.uuid4().hex}", int(time.time()), model_id(st), body)

    async def record(done: Done) -> dict:
        answered = shape.finished(done)
        if target.temporary:
            await drop(sv, target.cid)
            return answered
        row = ApiResponse(
            id=shape.id,
            owner_id=user.id,
            conversation_id=target.cid,
            message_id=done.message_id,
            previous_response_id=body.previous_response_id,
            body=answered,
            input_items=[i for e in entries for i in it.entry_items(e)],
        )
        await sv.store.add_response(row, shape.reply_item_id, [e.item_id for e in entries])
        return answered

    sink = ResponseSink(record, body.reads_calls())
    last = entries[-1]
    req = TurnRequest(last.text, sampling, body.max_output_tokens is not None,
                      role=last.stored_role, tools=[f.spec() for f in tools] or None,
                      retention=keep)  # fmt: skip
    check = before_turn(sv, target, entries, req, sink)

    async def turn() -> None:
        await ChatTurn(sv.turn_deps(), target.cid, sink).run(req, t0, check)
        if target.created and sink.body is None:  # refused or failed: leave nothing behind
            async with sv.hub.lock(target.cid):
                await drop(sv, target.cid)

    _, first = await start(sv, turn(), sink)
    refused = refusal(first)
    if refused is not None:
        return refused
    headers = {"X-Session-ID": target.cid}
    if body.stream:
        events = stream_events(shape, first, sink)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    event = first
    while isinstance(event, (str, Call)):
        event = await sink.events.get()
    if isinstance(event, Failed):
        return pipeline_error(event.code, event.message, event.retry_after_s).response()
    if not isinstance(event, Done) or sink.body is None:
        return ApiError(500, "the turn failed", "server_error").response()
    return JSONResponse(sink.body, headers=headers)


async def stream_events(shape: Shape, first, sink: ResponseSink):
    """The Responses API's server-sent events; a client that leaves cancels the turn. The
    reply's message item opens with its first text; each call is an item of its own, its
    arguments in one delta (a call is passed on once whole)."""
    numbers = itertools.count()
    outputs = itertools.count()  # output_index of the next item

    def event(kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": next(numbers), **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    message_at: int | None = None
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}

    def open_message():
        where = {"item_id": shape.reply_item_id, "output_index": message_at}
        item = {**shape.output_item("", "in_progress"), "content": []}
        yield event("response.output_item.added", output_index=message_at, item=item)
        yield event("response.content_part.added", **where, content_index=0, part=part)

    ended, calls = False, 0
    try:
        yield event("response.created", response=shape.json("in_progress", []))
        yield event("response.in_progress", response=shape.json("in_progress", []))
        e = first
        while True:
            if isinstance(e, str):
                if message_at is None:
                    message_at = next(outputs)
                    for x in open_message():
                        yield x
                yield event("response.output_text.delta", item_id=shape.reply_item_id,
                            output_index=message_at, content_index=0, delta=e, logprobs=[])  # fmt: skip
            elif isinstance(e, Call):
                at, item = next(outputs), shape.call_item(calls, e)
                calls += 1
                opened = {**item, "arguments": "", "status": "in_progress"}
                yield event("response.output_item.added", output_index=at, item=opened)
                args = {"item_id": item["id"], "output_index": at}
                yield event("response.function_call_arguments.delta", **args,
                            delta=item["arguments"])  # fmt: skip
                yield event("response.function_call_arguments.done", **args,
                            arguments=item["arguments"], name=item["name"])  # fmt: skip
                yield event("response.output_item.done", output_index=at, item=item)
            elif isinstance(e, Done) and sink.body is not None:
                item = next((o for o in sink.body["output"] if o["type"] == "message"), None)
                if item is not None:
                    if message_at is None:  # an empty reply: its item all the same
                        message_at = next(outputs)
                        for x in open_message():
                            yield x
                    where = {"item_id": item["id"], "output_index": message_at}
                    text = item["content"][0]["text"]
                    yield event("response.output_text.done", **where, content_index=0,
                                text=text, logprobs=[])  # fmt: skip
                    yield event("response.content_part.done", **where, content_index=0,
                                part=item["content"][0])  # fmt: skip
                    yield event("response.output_item.done", output_index=message_at, item=item)
                kind = "response.completed"
                if sink.body["status"] == "incomplete":
                    kind = "response.incomplete"
                yield event(kind, response=sink.body)
                break
            else:
                err = Failed("internal", "the turn failed") if not isinstance(e, Failed) else e
                api = pipeline_error(err.code, err.message, err.retry_after_s)
                failed = shape.json("failed", [], error={"code": api.code or err.code,
                                                         "message": err.message})  # fmt: skip
                yield event("response.failed", response=failed)
                break
            e = await sink.events.get()
        ended = True
    finally:
        if not ended:
            sink.gone()


async def _owned_response(request: Request) -> tuple[Services, ApiResponse]:
    sv = services(request)
    user = await owner(request)
    row = await sv.store.get_response(request.path_params["response_id"], user.id)
    if row is None:
        raise not_found("response")
    return sv, row


async def get_response(request: Request) -> Response:
    try:
        _, row = await _owned_response(request)
    except ApiError as e:
        return e.response()
    except DB_ERRORS:
        return UNAVAILABLE.response()
    return JSONResponse(row.body)


async def delete_response(request: Request) -> Response:
    try:
        sv, row = await _owned_response(request)
        await sv.store.delete_response(row.id, row.owner_id)
        sv.engine.unpin(row.conversation_id)  # its pin goes at once; the chat stays
        await sv.pin_caps.forget(row.owner_id, row.conversation_id)
        await retention.clear(sv.store, row.conversation_id)
    except ApiError as e:
        return e.response()
    except DB_ERRORS:
        return UNAVAILABLE.response()
    return JSONResponse({"id": row.id, "object": "response", "deleted": True})


async def input_items(request: Request) -> Response:
    try:
        _, row = await _owned_response(request)
        return JSONResponse(it.page(request, list(row.input_items)))
    except ApiError as e:
        return e.response()
    except DB_ERRORS:
        return UNAVAILABLE.response()


routes = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
    Route("/v1/responses/{response_id}/input_items", input_items, methods=["GET"]),
]
