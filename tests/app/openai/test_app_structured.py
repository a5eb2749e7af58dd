"""Structured output through /v1/chat/completions with the real `openai` client: replies
valid for their JSON schema at temperatures up to 1, json_object, min_tokens, refusals."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from tests.app.openai.schemas import SCHEMAS
from tests.app_fixtures import auth, server_on

pytestmark = pytest.mark.timeout(300)

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = {
        "PENSIEVE_GPU_CACHE_CHUNKS": "96",
        "PENSIEVE_CPU_CACHE_CHUNKS": "32",
        "PENSIEVE_TURNS_PER_MINUTE": "1000",
    }
    with server_on("sqlite", tmp_path_factory.mktemp("structured"), env) as srv:
        yield srv
    assert "Traceback" not in srv.log_tail(100_000)


@pytest.fixture(scope="module")
def token(server):
    return server.user("alice")


def fmt(name: str) -> dict:
    schema = SCHEMAS[name][1]
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


async def test_replies_follow_their_schemas(server, token):
    """Ten sampled replies over five schemas, two each, concurrently: all valid."""
    c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=token, max_retries=0)

    async def one(i: int, name: str):
        out = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": SCHEMAS[name][0]}],
            response_format=fmt(name),
            max_tokens=120,
            temperature=0.7 + 0.3 * (i % 2),
            seed=i,
        )
        return name, out

    jobs = [one(i, name) for i, name in enumerate(2 * list(SCHEMAS))]
    for name, out in await asyncio.gather(*jobs):
        assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMAS[name][1])
    await c.close()


def test_json_object_and_min_tokens(server, token):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=token, max_retries=0)
    out = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Reply in JSON: what is the capital of France?"}],
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0,
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    held = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say yes."}],
        max_tokens=30,
        temperature=0,
        extra_body={"min_tokens": 20},
    )
    assert held.usage.completion_tokens >= 20
    text = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say yes."}],
        response_format={"type": "text"},
        max_tokens=4,
    )
    assert text.choices[0].message.content


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": [1, 2]}},
        {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/no"}}},
        {"type": "yaml"},
        "json",
    ],
)
def test_a_bad_response_format_is_refused_before_the_turn(server, token, response_format):
    def chats() -> list[str]:
        r = httpx.get(server.url + "/api/conversations", headers=auth(token))
        return [c["id"] for c in r.json()["conversations"]]

    before = chats()
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=token, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            response_format=response_format,
            max_tokens=4,
        )
    assert e.value.status_code == 400 and e.value.body["param"] == "response_format"
    assert e.value.body["type"] == "invalid_request_error"
    assert chats() == before  # nothing stored for a refused request


def test_min_tokens_over_max_tokens_is_refused(server, token):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=token, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            extra_body={"min_tokens": 10},
        )
    assert e.value.body["param"] == "min_tokens"
