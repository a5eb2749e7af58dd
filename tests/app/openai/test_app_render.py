"""vLLM's render endpoints on a real server, as vllm-router's KV-aware policy calls them: a
chat's render is exactly the tokens its turn's engine holds through the prompt (the usage's
prompt tokens), its conversation's stream when the request is bound to one; a completion's
prompts render as the tokenizer reads them; bad bodies get clear errors."""

from __future__ import annotations

import httpx
import pytest

from tests.app.openai.test_app_openai import CHUNK, MODEL, ask, client, server, token  # noqa: F401
from tests.app.openai.test_app_tokens import post

CHAT, TEXT = "/v1/chat/completions/render", "/v1/completions/render"
USER = [{"role": "user", "content": "a"}]


def render(srv, key: str, messages: list[dict], headers: dict | None = None, **body) -> dict:
    r = httpx.post(
        srv.url + CHAT,
        json={"model": MODEL, "messages": messages, "max_tokens": 8, **body},
        headers={"Authorization": f"Bearer {key}", **(headers or {})},
    )
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize(
    "bind",
    [
        {"headers": {"X-Session-ID": "render-h"}},
        {"session_id": "render-b"},
        {"prompt_cache_key": "render-k"},
        {},  # no session: the stored chat the request extends
    ],
    ids=["header", "session_id", "prompt_cache_key", "prefix"],
)
def test_a_chat_renders_to_what_its_turn_computes(server, token, bind):  # noqa: F811
    """Each turn's render: the conversation's stream through this turn's prompt, the usage's
    prompt tokens; the next turn holds it (its cached tokens)."""
    c, name = client(server, token), str(sorted(bind.items()))
    messages = [{"role": "user", "content": f"Name a river, {name}."}]
    extra = {"extra_headers": bind["headers"]} if "headers" in bind else {}
    if "headers" not in bind:
        extra = {"extra_body": bind} if bind else {}
    before, cid = None, None
    for question in ["", "Another one?", "And a lake?"]:
        if question:
            messages.append({"role": "user", "content": question})
        out = render(server, token, messages, **bind)
        assert out["sampling_params"]["max_tokens"] == 8 and out["model"] == MODEL
        tokens = out["token_ids"]
        if before is not None:  # the stream so far is kept, never re-tokenized
            assert tokens[: len(before)] == before
        reply, cid_now = ask(c, messages, **extra)
        u = reply.usage
        assert u.prompt_tokens == len(tokens), (u, len(tokens))
        if before is not None:
            assert cid_now == cid
            assert u.prompt_tokens_details.cached_tokens >= len(before) - CHUNK
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        before, cid = tokens, cid_now


def test_an_edited_chat_renders_cut_back(server, token):  # noqa: F811
    """A request that edits its chat's earlier turn renders from what the edit keeps."""
    c, session = client(server, token), {"X-Session-ID": "render-edit"}
    messages = [{"role": "user", "content": "Count to three."}]
    reply, _ = ask(c, messages, extra_headers=session)
    messages += [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "Now to five."},
    ]
    ask(c, messages, extra_headers=session)
    edited = [{"role": "user", "content": "Count to four."}]
    tokens = render(server, token, edited, session)["token_ids"]
    fresh = post(server, token, "/tokenize", {"messages": edited}).json()["tokens"]
    assert tokens == fresh
    assert ask(c, edited, extra_headers=session)[0].usage.prompt_tokens == len(tokens)


def test_a_new_chat_renders_as_tokenize_does(server, token):  # noqa: F811
    messages = [{"role": "system", "content": "Be terse."},
                {"role": "user", "content": "A brand new question about render?"}]  # fmt: skip
    out = render(server, token, messages, stop=["\n\n"], temperature=0.5)
    tokenized = post(server, token, "/tokenize", {"messages": messages}).json()
    assert out["token_ids"] == tokenized["tokens"]
    assert out["request_id"].startswith("chatcmpl-") and out["features"] is None
    assert out["sampling_params"]["stop"] == ["\n\n"]
    assert out["sampling_params"]["temperature"] == 0.5


def test_completion_prompts_render_each(server, token):  # noqa: F811
    ids = post(server, token, "/tokenize", {"prompt": "Hello there, river."}).json()["tokens"]
    path = TEXT
    one = post(server, token, path, {"model": MODEL, "prompt": "Hello there, river."}).json()
    assert [o["token_ids"] for o in one] == [ids] and one[0]["request_id"].startswith("cmpl-")
    two = post(server, token, path, {"prompt": ["Hello there, river.", "Hi."]}).json()
    assert len(two) == 2 and two[0]["token_ids"] == ids
    assert [o["token_ids"] for o in post(server, token, path, {"prompt": ids}).json()] == [ids]
    nested = post(server, token, path, {"prompt": [ids, ids[:2]]}).json()
    assert [o["token_ids"] for o in nested] == [ids, ids[:2]]


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        (CHAT, {"messages": USER}, 400, "model: Field required"),
        (CHAT, {"model": MODEL}, 400, "messages: Field required"),
        (
            CHAT,
            {"model": MODEL, "messages": [{"role": "assistant", "content": "a"}]},
            400,
            "must end with a user message",
        ),
        (CHAT, {"model": "nope", "messages": USER}, 404, "does not exist"),
        (
            CHAT,
            {"model": MODEL, "messages": USER, "max_tokens": 10**9},
            400,
            "max_tokens: must be at most",
        ),
        (TEXT, {"model": MODEL}, 400, "prompt: Field required"),
        (TEXT, {"prompt": []}, 400, "give a prompt"),
        (TEXT, {"prompt": [-1]}, 400, "not in the vocabulary"),
        (TEXT, {"prompt": "a", "model": "nope"}, 404, "does not exist"),
    ],  # fmt: skip
)
def test_bad_bodies_are_refused_clearly(server, token, path, body, status, says):  # noqa: F811
    r = post(server, token, path, body)
    assert r.status_code == status and says in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("path", [CHAT, TEXT])
def test_a_key_is_needed(server, path):  # noqa: F811
    r = httpx.post(server.url + path, json={"model": MODEL, "prompt": "a"})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
