"""The OpenAI-compatible API under /v1 (and vLLM's `/version`), over the same stateful
conversations as the chat socket."""

from __future__ import annotations

from app.openai import chat, conversations, models, responses, tokens

routes = [*models.routes, *chat.routes, *responses.routes, *conversations.routes, *tokens.routes]
