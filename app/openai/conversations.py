"""The OpenAI Conversations API under /v1: a conversation "conv_<id>" is the stored
conversation <id> (listed under /api/conversations like any chat of its owner), its items
are its messages. Items added here are stored as messages without token ids: the next
turn's prompt renders them, as it renders the messages an API request adds ahead of its
own. A response made with `conversation` (app/openai/responses.py) appends its input and
its reply, continuing the conversation's KV."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.cluster import handoff
from app.hub import UNKNOWN_CHAT
from app.openai import items as it
from app.openai.access import body_of, check_metadata, not_found, owner, validate
from app.openai.errors import UNAVAILABLE, ApiError
from app.openai.items import CONVERSATION_PREFIX, conversation_key, page
from app.openai.serving import TITLE_CHARS, check_quota, drop
from app.services import Services, services
from app.turns.pipeline import DB_ERRORS

MAX_ITEMS = 20  # OpenAI's limit per request


class NewConversation(BaseModel):
    model_config = ConfigDict(extra="ignore")
    items: list | None = Field(None, max_length=MAX_ITEMS)
    metadata: dict[str, str] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(value)


class NewItems(BaseModel):
    model_config = ConfigDict(extra="ignore")
    items: list = Field(min_length=1, max_length=MAX_ITEMS)


def conversation_json(conv) -> dict:
    return {
        "id": CONVERSATION_PREFIX + conv.id,
        "object": "conversation",
        "created_at": int(conv.created.timestamp()),
        "metadata": conv.api_metadata or {},
    }


async def _owned(request: Request):
    sv = services(request)
    user = await owner(request)
    key = conversation_key(request.path_params["conversation_id"])
    conv = key and await sv.store.get_conversation(key, user.id)
    if not conv:
        raise not_found("conversation")
    return sv, user, conv


async def _append(sv: Services, cid: str, entries: list[it.Entry]) -> list[dict]:
    """Store the items at the end of the conversation, under its lock (after any turn)."""
    added = []
    async with sv.hub.lock(cid):
        for e in entries:
            m = await sv.store.append_message(cid, e.stored_role, e.text, [], item_id=e.item_id)
            added += it.items_of(m)
    return added


def _api(handler):
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as e:
            return e.response()
        except DB_ERRORS:
            return UNAVAILABLE.response()

    return wrapped


@_api
async def create_conversation(request: Request) -> Response:
    sv = services(request)
    user = await owner(request)
    body: NewConversation = validate(NewConversation, await body_of(request, sv))
    entries = it.parse_items(body.items or [], sv.settings.max_message_chars, "items")
    await check_quota(sv, user.id)
    first = next((e.text for e in entries if e.role == "user"), "")
    title = " ".join(first.split())[:TITLE_CHARS]
    conv = await sv.store.create_conversation(user.id, title, api_metadata=body.metadata or {})
    await _append(sv, conv.id, entries)
    return JSONResponse(conversation_json(conv))


@_api
async def get_conversation(request: Request) -> Response:
    _, _, conv = await _owned(request)
    return JSONResponse(conversation_json(conv))


@_api
async def delete_conversation(request: Request) -> Response:
    sv, user, conv = await _owned(request)
    relayed = await handoff.forward_turn(request, b"", conv.id)  # its home frees its cache
    if relayed is not None:
        return relayed
    await sv.hub.close_chat(conv.id, UNKNOWN_CHAT, "chat deleted")
    async with sv.hub.lock(conv.id):
        await sv.store.delete_conversation(conv.id)
        await drop(sv, conv.id)  # its cache and activity
    return JSONResponse(
        {"id": CONVERSATION_PREFIX + conv.id, "object": "conversation.deleted", "deleted": True}
    )


@_api
async def list_items(request: Request) -> Response:
    sv, _, conv = await _owned(request)
    messages = await sv.store.messages(conv.id)
    return JSONResponse(page(request, [i for m in messages for i in it.items_of(m)]))


@_api
async def add_items(request: Request) -> Response:
    sv, _, conv = await _owned(request)
    raw = await body_of(request, sv)
    body: NewItems = validate(NewItems, raw)
    entries = it.parse_items(body.items, sv.settings.max_message_chars, "items")
    relayed = await handoff.forward_turn(request, raw, conv.id)
    if relayed is not None:
        return relayed
    added = await _append(sv, conv.id, entries)
    return JSONResponse(
        {
            "object": "list",
            "data": added,
            "first_id": added[0]["id"],
            "last_id": added[-1]["id"],
            "has_more": False,
        }
    )


routes = [
    Route("/v1/conversations", create_conversation, methods=["POST"]),
    Route("/v1/conversations/{conversation_id}", get_conversation, methods=["GET"]),
    Route("/v1/conversations/{conversation_id}", delete_conversation, methods=["DELETE"]),
    Route("/v1/conversations/{conversation_id}/items", list_items, methods=["GET"]),
    Route("/v1/conversations/{conversation_id}/items", add_items, methods=["POST"]),
]
