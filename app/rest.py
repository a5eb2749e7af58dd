"""REST under /api: a user's conversations and their messages."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.http import MAX_SYSTEM_PROMPT, BadRequest, Text, current_user, parse_body, problem
from app.hub import UNKNOWN_CHAT
from app.services import services

MAX_TITLE = 200


class NewConversation(BaseModel):
    """The body of POST /api/conversations."""

    model_config = ConfigDict(extra="forbid", strict=True)

    title: Text(MAX_TITLE) | None = None
    system_prompt: Text(MAX_SYSTEM_PROMPT) | None = None


class Rename(BaseModel):
    """The body of PATCH /api/conversations/{id}."""

    model_config = ConfigDict(extra="forbid", strict=True)

    title: Text(MAX_TITLE)


def conversation_json(c) -> dict:
    return {
        "id": c.id,
        "title": c.title,
        "system_prompt": c.system_prompt,
        "created": c.created.isoformat(),
        "updated": c.updated.isoformat(),
    }


def message_json(m) -> dict:
    return {
        "id": m.id,
        "seq": m.seq,
        "role": m.role,
        "content": m.content,
        "finish_reason": m.finish_reason,
        "tokens": m.token_count,
        "created": m.created.isoformat(),
    }


async def _owned(request: Request):
    """(user, conversation) or the error response to return."""
    user = await current_user(request)
    if user is None:
        return None, problem(401, "unauthorized", "send Authorization: Bearer <token>")
    store = services(request).store
    conv = await store.get_conversation(request.path_params["conversation_id"])
    if conv is None:
        return None, problem(404, "not_found", "no such conversation")
    if conv.owner_id != user.id:
        return None, problem(403, "forbidden", "not your conversation")
    return conv, None


async def create_conversation(request: Request) -> Response:
    user = await current_user(request)
    if user is None:
        return problem(401, "unauthorized", "send Authorization: Bearer <token>")
    try:
        body = await parse_body(request, NewConversation)
    except BadRequest as e:
        return problem(e.status, e.code, e.message)
    sv = services(request)
    quota = sv.settings.max_chats_per_owner
    if await sv.store.count_conversations(user.id) >= quota:
        return problem(
            409, "too_many_chats", f"an owner may keep at most {quota} chats; delete one first"
        )
    conv = await sv.store.create_conversation(
        user.id, (body.title or "").strip(), body.system_prompt or sv.settings.system_prompt
    )
    return JSONResponse({"id": conv.id, **conversation_json(conv)}, status_code=201)


async def list_conversations(request: Request) -> Response:
    user = await current_user(request)
    if user is None:
        return problem(401, "unauthorized", "send Authorization: Bearer <token>")
    convs = await services(request).store.list_conversations(user.id)
    return JSONResponse({"conversations": [conversation_json(c) for c in convs]})


async def get_conversation(request: Request) -> Response:
    conv, err = await _owned(request)
    if err:
        return err
    messages = await services(request).store.messages(conv.id)
    return JSONResponse(
        {**conversation_json(conv), "messages": [message_json(m) for m in messages]}
    )


async def rename_conversation(request: Request) -> Response:
    conv, err = await _owned(request)
    if err:
        return err
    try:
        body = await parse_body(request, Rename)
    except BadRequest as e:
        return problem(e.status, e.code, e.message)
    title = " ".join(body.title.split())
    if not title:
        return problem(400, "bad_request", "title: must not be blank")
    store = services(request).store
    await store.set_title(conv.id, title)
    return JSONResponse(conversation_json(await store.get_conversation(conv.id)))


async def delete_conversation(request: Request) -> Response:
    conv, err = await _owned(request)
    if err:
        return err
    sv = services(request)
    # Close its socket (which cancels a running turn) and wait for that turn to commit,
    # so nothing writes to the chat or holds its cache once it is gone.
    await sv.hub.close_chat(conv.id, UNKNOWN_CHAT, "chat deleted")
    async with sv.hub.lock(conv.id):
        await sv.store.delete_conversation(conv.id)
        await sv.engine.free(conv.id, erase=True)  # its pin too
        await sv.pin_caps.forget(conv.owner_id, conv.id)
        forget = getattr(sv.clock, "forget", None)
        if forget:
            forget(conv.id)
    return Response(status_code=204)


routes = [
    Route("/api/conversations", create_conversation, methods=["POST"]),
    Route("/api/conversations", list_conversations, methods=["GET"]),
    Route("/api/conversations/{conversation_id}", get_conversation, methods=["GET"]),
    Route("/api/conversations/{conversation_id}", rename_conversation, methods=["PATCH"]),
    Route("/api/conversations/{conversation_id}", delete_conversation, methods=["DELETE"]),
]
