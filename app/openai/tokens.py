"""vLLM's token endpoints: `POST /tokenize` (a prompt, or a chat's messages rendered as a
new chat's first turn is: the tokens the engine would compute for it) and `POST /detokenize`.
A router that scores engines by the tokens of a request (vllm-router's KV-aware policy) asks
them here."""

from __future__ import annotations

from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.openai.access import body_of, check_model, owner, validate
from app.openai.chat import ChatMessage
from app.openai.errors import UNAVAILABLE, ApiError
from app.services import services
from app.turns.pipeline import DB_ERRORS
from app.turns.prompt import encode, render

MAX_TOKENS = 1 << 20  # a detokenize request's ids


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=10_000)
    add_special_tokens: bool = True  # a prompt's (the template places a chat's)


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_TOKENS)


async def _body(request: Request, kind: type[BaseModel]):
    """The caller owns an API key, and names this server's model if any."""
    await owner(request)
    sv = services(request)
    body = validate(kind, await body_of(request, sv))
    if body.model is not None:
        check_model(sv, body.model)
    return sv, body


async def tokenize(request: Request) -> Response:
    try:
        sv, body = await _body(request, TokenizeBody)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give either prompt or messages", param="prompt")
        tok = sv.engine.tokenizer
        if body.messages is not None:
            messages = [
                {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in body.messages
            ]
            try:
                tokens = encode(tok, render(tok, messages))
            except TemplateError as e:  # the template refused the chat (roles out of order)
                raise ApiError(400, f"messages: the chat template refused them: {e}") from None
        else:
            tokens = tok(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
    except ApiError as e:
        return e.response()
    except DB_ERRORS:
        return UNAVAILABLE.response()
    limit = sv.engine.context_limit
    return JSONResponse({"count": len(tokens), "max_model_len": limit, "tokens": tokens})


async def detokenize(request: Request) -> Response:
    try:
        sv, body = await _body(request, DetokenizeBody)
        vocab = len(sv.engine.tokenizer)
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(
                400, f"token id {bad} is not in the vocabulary ({vocab})", param="tokens"
            )
    except ApiError as e:
        return e.response()
    except DB_ERRORS:
        return UNAVAILABLE.response()
    return JSONResponse({"prompt": sv.engine.tokenizer.decode(body.tokens)})


routes = [
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
]
