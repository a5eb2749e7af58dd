"""REST under /api: a user's conversations and their messages."""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.auth import owner_token
from app.chat import UNKNOWN_CHAT

MAX_TITLE = 200
MAX_SYSTEM_PROMPT = 16_000


def problem(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": code, "message": message}, status_code=status)


async def current_user(request: Request):
    token = owner_token(request)
    return await request.app.state.services.store.user_by_token(token) if token else None


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
    store = request.app.state.services.store
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
    raw = await request.body()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return problem(400, "bad_json", "the body must be a JSON object")
    if not isinstance(body, dict):
        return problem(400, "bad_json", "the body must be a JSON object")
    unknown = set(body) - {"title", "system_prompt"}
    if unknown:
        return problem(400, "bad_request", f"unknown fields: {', '.join(sorted(unknown))}")
    title = body.get("title") or ""
    system_prompt = body.get("system_prompt")
    if not isinstance(title, str) or len(title) > MAX_TITLE:
        return problem(
            400, "bad_request", f"title must be a string of at most {MAX_TITLE} characters"
        )
    if system_prompt is not None and (
        not isinstance(system_prompt, str) or len(system_prompt) > MAX_SYSTEM_PROMPT
    ):
        return problem(
            400,
            "bad_request",
            f"system_prompt must be a string of at most {MAX_SYSTEM_PROMPT} characters",
        )
    sv = request.app.state.services
    conv = await sv.store.create_conversation(
        user.id, title.strip(), system_prompt or sv.settings.system_prompt
    )
    return JSONResponse({"id": conv.id, **conversation_json(conv)}, status_code=201)


async def list_conversations(request: Request) -> Response:
    user = await current_user(request)
    if user is None:
        return problem(401, "unauthorized", "send Authorization: Bearer <token>")
    convs = await request.app.state.services.store.list_conversations(user.id)
    return JSONResponse({"conversations": [conversation_json(c) for c in convs]})


async def get_conversation(request: Request) -> Response:
    conv, err = await _owned(request)
    if err:
        return err
    messages = await request.app.state.services.store.messages(conv.id)
    return JSONResponse(
        {**conversation_json(conv), "messages": [message_json(m) for m in messages]}
    )


async def delete_conversation(request: Request) -> Response:
    conv, err = await _owned(request)
    if err:
        return err
    sv = request.app.state.services
    # Close its socket (which cancels a running turn) and wait for that turn to commit,
    # so nothing writes to the chat or holds its cache once it is gone.
    await sv.hub.close_chat(conv.id, UNKNOWN_CHAT, "chat deleted")
    async with sv.hub.lock(conv.id):
        await sv.store.delete_conversation(conv.id)
        await sv.engine.free(conv.id)
        forget = getattr(sv.clock, "forget", None)
        if forget:
            forget(conv.id)
    return Response(status_code=204)


routes = [
    Route("/api/conversations", create_conversation, methods=["POST"]),
    Route("/api/conversations", list_conversations, methods=["GET"]),
    Route("/api/conversations/{conversation_id}", get_conversation, methods=["GET"]),
    Route("/api/conversations/{conversation_id}", delete_conversation, methods=["DELETE"]),
]
