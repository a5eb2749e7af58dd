"""vLLM's token endpoints: `POST /tokenize` (a prompt, or a chat's messages rendered as a
new chat's first turn is: the tokens the engine would compute for it), `POST /detokenize`,
and the render endpoints: `POST /v1/chat/completions/render` (a chat completion's body: the
tokens its turn's engine holds through the prompt, its conversation's stream when it is
bound to one: app/openai/render.py) and `POST /v1/completions/render` (a completion's
prompts, tokenized). A router that scores engines by the tokens of a request (vllm-router's
KV-aware policy, llm-d's scorer) asks them here.

The render endpoints answer as vLLM's do: a chat's is a `GenerateRequest` (`token_ids`,
`sampling_params`, `request_id`, ...; vllm/entrypoints/serve/disagg/protocol.py), a
completion's a list of them, one a prompt."""

from __future__ import annotations

import uuid

from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.openai import chat as cc
from app.openai.access import body_of, check_model, owner, validate
from app.openai.chat import ChatMessage
from app.openai.errors import UNAVAILABLE, ApiError
from app.openai.render import plan_for
from app.services import services
from app.turns.pipeline import DB_ERRORS
from app.turns.prompt import encode, render
from app.turns.window import NoRoom
from engine.types import SamplingParams

MAX_TOKENS = 1 << 20  # a detokenize request's ids


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=10_000)
    add_special_tokens: bool = True  # a prompt's (the template places a chat's)


class CompletionRenderBody(BaseModel):
    """The body of vLLM's /v1/completions; what changes no token is ignored."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # vLLM's default
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stream: bool | None = False
    add_special_tokens: bool = True

    @field_validator("prompt")
    @classmethod
    def _some(cls, value):
        if not value:
            raise ValueError("give a prompt: a string, strings, token ids or lists of them")
        return value


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


def _generate_request(
    kind: str, tokens: list[int], sampling: SamplingParams, stop: list[str], body
) -> dict:
    """vLLM's `GenerateRequest`: the prompt's ids and the sampling the engine would use."""
    return {
        "request_id": f"{kind}-{uuid.uuid4().hex}",
        "token_ids": tokens,
        "features": None,
        "sampling_params": {
            "n": 1,
            "max_tokens": sampling.max_tokens,
            "min_tokens": sampling.min_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "seed": sampling.seed,
            "stop": stop,
            "ignore_eos": sampling.ignore_eos,
        },
        "model": body.model,
        "stream": bool(body.stream),
        "stream_options": None,
        "cache_salt": None,
        "priority": 0,
        "kv_transfer_params": None,
    }


async def render_chat(request: Request) -> Response:
    """The tokens the engine holds through this chat request's prompt once its turn is
    planned: its conversation's kept stream and the turn's new tokens."""
    sv = services(request)
    try:
        user = await owner(request)
        body = cc.parse(await body_of(request, sv))
        check_model(sv, body.model)
        chat = cc.chat_of(body, sv.settings.max_message_chars)
        st = sv.settings
        sampling, given = cc.sampling_of(body, st.max_tokens_default, st.max_tokens_limit)
        tools = [f.spec() for f in cc.tools_of(body)] or None
        cid = await cc.bound_conversation(sv, user.id, chat, cc.session_of(request, body))
        try:
            plan = await plan_for(sv, cid, chat, sampling, given, tools)
        except NoRoom as e:
            raise ApiError(400, str(e), param="messages") from None
        except TemplateError as e:
            raise ApiError(400, f"messages: the chat template refused them: {e}") from None
    except ApiError as e:
        return e.response()
    except DB_ERRORS:
        return UNAVAILABLE.response()
    sampling.max_tokens = plan.max_tokens  # as the turn's window leaves it
    sampling.min_tokens = min(sampling.min_tokens, plan.max_tokens)
    out = _generate_request("chatcmpl", plan.stream, sampling, body.stop or [], body)
    return JSONResponse(out, headers={"X-Session-ID": cid} if cid else None)


async def render_completion(request: Request) -> Response:
    """Each prompt's tokens, as vLLM's /v1/completions would compute them."""
    try:
        sv, body = await _body(request, CompletionRenderBody)
        tok, limit = sv.engine.tokenizer, sv.engine.context_limit
        prompts = body.prompt if isinstance(body.prompt, list) else [body.prompt]
        if all(isinstance(p, int) for p in prompts):
            prompts = [prompts]  # one prompt of token ids
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                tokens = tok(p, add_special_tokens=body.add_special_tokens)["input_ids"]
            else:
                tokens = _checked_ids(p, len(tok), f"prompt.{i}")
            if not tokens or len(tokens) >= limit:
                raise ApiError(400, f"prompt {i} has {len(tokens)} tokens; it needs 1 to "
                               f"{limit - 1} here", param="prompt")  # fmt: skip
            sampling = SamplingParams(
                max_tokens=min(body.max_tokens or limit, limit - len(tokens)),
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=max(0, body.top_k or 0),
                seed=body.seed,
                ignore_eos=body.ignore_eos,
                min_tokens=body.min_tokens,
            )
            out.append(_generate_request("cmpl", tokens, sampling, stop, body))
    except ApiError as e:
        return e.response()
    except DB_ERRORS:
        return UNAVAILABLE.response()
    return JSONResponse(out)


def _checked_ids(tokens: list[int], vocab: int, param: str) -> list[int]:
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is not in the vocabulary ({vocab})", param=param)
    return tokens


async def detokenize(request: Request) -> Response:
    try:
        sv, body = await _body(request, DetokenizeBody)
        _checked_ids(body.tokens, len(sv.engine.tokenizer), "tokens")
    except ApiError as e:
        return e.response()
    except DB_ERRORS:
        return UNAVAILABLE.response()
    return JSONResponse({"prompt": sv.engine.tokenizer.decode(body.tokens)})


routes = [
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/v1/chat/completions/render", render_chat, methods=["POST"]),
    Route("/v1/completions/render", render_completion, methods=["POST"]),
]
