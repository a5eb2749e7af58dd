"""Items of the Responses and Conversations APIs, and the stored messages they are.

An item a client sends becomes an `Entry`; today every entry is a message (`role`, `text`)
and is stored as one. Function calls and their outputs will be entries of kinds of their
own, stored as messages the chat template renders with its tool markup: `parse_items` is
the one place that reads item types and `item_of` / `message_item` the ones that write
them, so adding a kind touches these and the store's roles, not the endpoints."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from app.frames import check_text
from app.openai.errors import ApiError

# API roles -> the stored roles (the chat template has no developer role).
STORED_ROLE = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")
# Item types the API has that this server does not take yet (tools come next).
NOT_YET = {
    "function_call": "function_call items are not supported yet",
    "function_call_output": "function_call_output items are not supported yet",
}


@dataclass
class Entry:
    """One item that goes into a conversation."""

    role: str  # the API's role: user, assistant, system or developer
    text: str
    item_id: str  # "msg_...": the id it is listed under
    kind: str = "message"  # later also function_call, function_call_output

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


def parse_items(raw, max_chars: int, param: str = "input") -> list[Entry]:
    """The entries of a request's items: a string is one user message; a list holds
    message items (`type` "message", optional)."""
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
        if kind in NOT_YET:
            raise _bad(NOT_YET[kind], f"{where}.type")
        if kind != "message":
            raise _bad(f"items of type {kind!r:.40} are not supported", f"{where}.type")
        role = item.get("role")
        if role not in STORED_ROLE:
            raise _bad("role must be user, assistant, system or developer", f"{where}.role")
        text = _text(item.get("content"), f"{where}.content")
        problem = check_text(text)
        if problem or len(text) > max_chars:
            why = problem or f"has {len(text)} characters, the limit is {max_chars}"
            raise _bad(why, f"{where}.content")
        entries.append(Entry(role, text, new_item_id()))
    return entries


def message_item(item_id: str, role: str, text: str, status: str = "completed") -> dict:
    """A message item as the API shows it: input text, or the assistant's output text."""
    if role == "assistant":
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    else:
        part = {"type": "input_text", "text": text}
    return {"type": "message", "id": item_id, "status": status, "role": role, "content": [part]}


def entry_item(entry: Entry) -> dict:
    return message_item(entry.item_id, entry.role, entry.text)


def item_id_of(message) -> str:
    return message.item_id or f"msg_{message.id}"


def item_of(message) -> dict:
    """A stored message as an item."""
    cut = message.finish_reason in ("length", "cancelled", "error")
    status = "incomplete" if message.role == "assistant" and cut else "completed"
    return message_item(item_id_of(message), message.role, message.content, status)
