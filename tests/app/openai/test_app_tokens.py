"""vLLM's token endpoints on a real server: a chat's messages tokenize to exactly what its
first turn computes (the usage's prompt tokens), a prompt as the tokenizer reads it, and
ids detokenize back; bad input gets a clear error."""

from __future__ import annotations

import httpx
import pytest

from tests.app.openai.test_app_openai import MODEL, ask, client, server, token  # noqa: F401

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name three rivers of Europe, please."},
]


def post(srv, key: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers={"Authorization": f"Bearer {key}"})


def test_messages_tokenize_to_what_the_first_turn_computes(server, token):  # noqa: F811
    r = post(server, token, "/tokenize", {"model": MODEL, "messages": MESSAGES})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["count"] == len(out["tokens"]) > 10 and out["max_model_len"] > 0
    reply, _ = ask(client(server, token), MESSAGES, extra_headers={"X-Session-ID": "tok-1"})
    assert reply.usage.prompt_tokens == out["count"]
    text = post(server, token, "/detokenize", {"model": MODEL, "tokens": out["tokens"]}).json()
    assert "Name three rivers of Europe, please." in text["prompt"]


def test_a_prompt_tokenizes_and_detokenizes_back(server, token):  # noqa: F811
    ids = post(server, token, "/tokenize", {"prompt": "Hello there, river."}).json()["tokens"]
    assert post(server, token, "/detokenize", {"tokens": ids}).json() == {
        "prompt": "Hello there, river."
    }


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        ("/tokenize", {}, 400, "either prompt or messages"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "either prompt or messages"),
        ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "does not exist"),
        ("/detokenize", {"tokens": [-1]}, 400, "not in the vocabulary"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
def test_bad_input_is_refused_clearly(server, token, path, body, status, says):  # noqa: F811
    r = post(server, token, path, body)
    assert r.status_code == status and says in r.json()["error"]["message"], r.text


def test_a_key_is_needed(server):  # noqa: F811
    r = httpx.post(server.url + "/tokenize", json={"prompt": "a"})
    assert r.status_code == 401
