"""Items of the Responses and Conversations APIs, and the stored messages they are.

An item a client sends becomes an `Entry`, stored as one message: a message item as
itself; `function_call` items as the assistant message they belong to (the reply's text
with its calls in app/turns/toolcalls.py's format), a `function_call_output` as a `tool`
message whose item id is the call's id. `parse_items` is the one place that reads item
types and `items_of` / `message_item` the ones that write them.

A reply's calls are listed under ids derived from the reply's item id, so a stored reply
lists the same `fc_`/`call_` ids the response gave."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from starlette.requests import Request

from app.openai.errors import ApiError
from app.turns.request import check_text
from app.turns.toolcalls import Call, parse, reply_text

# API roles -> the stored roles (the chat template has no developer role).
STORED_ROLE = {
    "user": "user",
    "assistant": "assistant",
    "system": "system",
    "developer": "system",
    "tool": "tool",
}
CONVERSATION_PREFIX = "conv_"  # an API conversation id: the prefix and a stored id
TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass
class Entry:
    """One item that goes into a conversation."""

    role: str  # the API's role: user, assistant, system, developer; tool for an output
    text: str
    item_id: str  # "msg_...": the id it is listed under; a function's output: the call's id
    kind: str = "message"  # or function_call_output
    item: dict | None = None  # as the client sent it (a reply with calls: its items)

    @property
    def stored_role(self) -> str:
        return STORED_ROLE[self.role]


def new_item_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def _text(content, param: str) -> str:
    """A message's text: a string, or a list of text parts (joined by newlines)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("must be a string or a list of input_text parts", param)
    texts = []
    for j, part in enumerate(content):
        where = f"{param}.{j}"
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_image", "input_file", "input_audio"):
                raise _bad(f"{kind} parts are not supported by this model", where)
            raise _bad("must be an input_text part with a text string", where)
        if part.get("type", "input_text") not in TEXT_PARTS:
            raise _bad(f"parts of type {part.get('type')!r:.40} are not supported", where)
        texts.append(part["text"])
    return "\n".join(texts)


def _call(item: dict, where: str) -> Call:
    name, args = item.get("name"), item.get("arguments")
    if not isinstance(name, str) or not isinstance(item.get("call_id"), str):
        raise _bad("a function_call needs a name and a call_id", where)
    try:
        args = json.loads(args) if isinstance(args, str) else None
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise _bad("arguments must be a JSON object, as a string", f"{where}.arguments")
    return Call(name, args)


def parse_items(raw, max_chars: int, param: str = "input") -> list[Entry]:
    """The entries of a request's items: a string is one user message; a list holds
    message items (`type` "message", optional), function calls (joined to the assistant
    message before them into one reply) and function call outputs."""
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise _bad("must be a string or a list of items", param)
    entries = []
    for i, item in enumerate(raw):
        where = f"{param}.{i}"
        if not isinstance(item, dict):
            raise _bad("must be an item object", where)
        kind = item.get("type", "message")
        if kind == "function_call":
            call = _call(item, where)
            last = entries[-1] if entries else None
            if last is not None and last.role == "assistant":  # the reply it belongs to
                content, calls = parse(last.text)
                last.text = reply_text(content, [*calls, call])
            else:
                entries.append(Entry("assistant", reply_text(None, [call]), new_item_id()))
            continue
        if kind == "function_call_output":
            output, call_id = item.get("output"), item.get("call_id")
            if not isinstance(call_id, str) or not 0 < len(call_id) <= 64:
                raise _bad("a function_call_output needs its call_id", f"{where}.call_id")
            if not isinstance(output, str):
                output = _text(output, f"{where}.output")
            entries.append(_checked(Entry("tool", output, call_id, kind), max_chars, where))
            continue
        if kind != "message":
            raise _bad(f"items of type {kind!r:.40} are not supported", f"{where}.type")
        role = item.get("role")
        if role not in STORED_ROLE:
            raise _bad("role must be user, assistant, system or developer", f"{where}.role")
        text = _text(item.get("content"), f"{where}.content")
        entries.append(_checked(Entry(role, text, new_item_id()), max_chars, f"{where}.content"))
    return entries


def _checked(entry: Entry, max_chars: int, where: str) -> Entry:
    problem = check_text(entry.text)
    if problem or len(entry.text) > max_chars:
        why = problem or f"has {len(entry.text)} characters, the limit is {max_chars}"
        raise _bad(why, where)
    return entry


def message_item(item_id: str, role: str, text: str, status: str = "completed") -> dict:
    """A message item as the API shows it: input text, or the assistant's output text."""
    if role == "assistant":
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    else:
        part = {"type": "input_text", "text": text}
    return {"type": "message", "id": item_id, "status": status, "role": role, "content": [part]}


def call_item(reply_item_id: str, index: int, call: Call) -> dict:
    """A reply's `index`-th call as a function_call item (ids derived from the reply's)."""
    key = reply_item_id.removeprefix("msg_")
    return {
        "type": "function_call",
        "id": f"fc_{key}_{index}",
        "call_id": f"call_{key}_{index}",
        "name": call.name,
        "arguments": json.dumps(call.arguments, ensure_ascii=False),
        "status": "completed",
    }


def reply_items(item_id: str, text: str, status: str, calls: bool) -> list[dict]:
    """A reply as items: its message (when it has text), then a function_call per call;
    `calls`: whether its calls are read (tools were offered)."""
    content, found = parse(text) if calls else (text, [])
    out = [message_item(item_id, "assistant", content, status)] if content or not found else []
    return out + [call_item(item_id, i, c) for i, c in enumerate(found)]


def output_item(item_id: str, call_id: str, output: str) -> dict:
    return {
        "type": "function_call_output",
        "id": f"fco_{item_id}",
        "call_id": call_id,
        "output": output,
        "status": "completed",
    }


def entry_items(entry: Entry) -> list[dict]:
    if entry.kind == "function_call_output":
        return [output_item(uuid.uuid4().hex, entry.item_id, entry.text)]
    if entry.role == "assistant":
        return reply_items(entry.item_id, entry.text, "completed", True)
    return [message_item(entry.item_id, entry.role, entry.text)]


def item_id_of(message) -> str:
    return message.item_id or f"msg_{message.id}"


def items_of(message) -> list[dict]:
    """A stored message as items."""
    if message.role == "tool":
        return [output_item(str(message.id), message.item_id or "", message.content)]
    cut = message.finish_reason in ("length", "cancelled", "error")
    status = "incomplete" if message.role == "assistant" and cut else "completed"
    if message.role == "assistant":
        return reply_items(item_id_of(message), message.content, status, True)
    return [message_item(item_id_of(message), message.role, message.content, status)]


def conversation_key(conv_id: str) -> str | None:
    """The stored conversation an API conversation id names."""
    if conv_id.startswith(CONVERSATION_PREFIX) and len(conv_id) <= 64:
        return conv_id[len(CONVERSATION_PREFIX) :]
    return None


def page(request: Request, data: list[dict]) -> dict:
    """A list object of items, with OpenAI's `order` (default desc), `after` and `limit`."""
    q = request.query_params
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, "order: must be asc or desc", param="order")
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise ApiError(400, "limit: must be an integer from 1 to 100", param="limit")
    if order == "desc":
        data = data[::-1]
    after = q.get("after")
    if after:
        ids = [d["id"] for d in data]
        data = data[ids.index(after) + 1 :] if after in ids else []
    shown = data[:limit]
    return {
        "object": "list",
        "data": shown,
        "first_id": shown[0]["id"] if shown else None,
        "last_id": shown[-1]["id"] if shown else None,
        "has_more": len(data) > limit,
    }
