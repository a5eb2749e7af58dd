"""Editing a sent message, regenerating the last reply, renaming a chat: a real server with
the bundled model. An edited chat must answer, and hold in its cache, exactly what a chat
that had been sent the edited message in the first place does."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.app_fixtures import TINY, auth, connect, recv, say, server_on, until_done

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = {**TINY, "PENSIEVE_TURNS_PER_MINUTE": "1000"}
    with server_on("sqlite", tmp_path_factory.mktemp("edit"), env) as srv:
        yield srv


@pytest.fixture(scope="module")
def token(server):
    return server.user("editor")


def history(server, token, cid):
    return [(m["seq"], m["role"], m["content"]) for m in server.chat(token, cid)["messages"]]


def engine_tokens(server, cid) -> int:
    return next(c["tokens"] for c in server.cache()["conversations"] if c["id"] == cid)


async def edit(ws, seq: int, content: str, **sampling):
    await ws.send(json.dumps({"type": "edit", "seq": seq, "content": content, **sampling}))
    return await until_done(ws)


async def test_edit_cuts_history_and_cache_back(server, token):
    first, second, edited = "Name a fruit.", "Name a colour.", "Name an animal."
    cid = server.new_chat(token)
    async with connect(server, cid, token) as ws:
        a = await say(ws, first, max_tokens=10)
        await say(ws, second, max_tokens=10)
        before = engine_tokens(server, cid)
        r = await edit(ws, 2, edited, max_tokens=10)
    assert r.errors == []
    h = history(server, token, cid)
    assert [(s, role) for s, role, _ in h] == [
        (0, "user"),
        (1, "assistant"),
        (2, "user"),
        (3, "assistant"),
    ]
    assert h[0][2] == first and h[1][2] == a.text and h[2][2] == edited and h[3][2] == r.text
    # The kept turn came from the cache, not recomputed.
    assert r.done["usage"]["cached_tokens"] > 0
    # A chat that was asked the edited question directly: same reply, same cache length.
    fresh = server.new_chat(token)
    async with connect(server, fresh, token) as ws:
        await say(ws, first, max_tokens=10)
        want = await say(ws, edited, max_tokens=10)
    assert r.text == want.text
    assert engine_tokens(server, cid) == engine_tokens(server, fresh) < before + 40

    # Editing the first message leaves one turn.
    async with connect(server, cid, token) as ws:
        r0 = await edit(ws, 0, edited, max_tokens=10)
    assert [role for _, role, _ in history(server, token, cid)] == ["user", "assistant"]
    other = server.new_chat(token)
    async with connect(server, other, token) as ws:
        want0 = await say(ws, edited, max_tokens=10)
    assert r0.text == want0.text
    assert engine_tokens(server, cid) == engine_tokens(server, other)


async def test_regenerate_answers_the_last_question_again(server, token):
    cid = server.new_chat(token)
    async with connect(server, cid, token) as ws:
        await say(ws, "Say one word.", max_tokens=8)
        r1 = await say(ws, "Say another word.", max_tokens=8)
        old = server.chat(token, cid)["messages"]
        await ws.send(json.dumps({"type": "regenerate", "max_tokens": 8}))
        r2 = await until_done(ws)
    assert r2.errors == [] and r2.text == r1.text  # greedy: the same reply
    msgs = server.chat(token, cid)["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant"] * 2
    assert msgs[2]["content"] == "Say another word."
    assert [m["id"] for m in msgs[:2]] == [m["id"] for m in old[:2]]
    assert msgs[3]["created"] > old[3]["created"]  # a new reply (SQLite may reuse its id)
    assert r2.done["message_id"] == msgs[3]["id"]


async def test_edit_and_regenerate_refusals(server, token):
    cid = server.new_chat(token)
    async with connect(server, cid, token) as ws:
        await ws.send(json.dumps({"type": "regenerate"}))
        assert (await recv(ws))["code"] == "nothing_to_regenerate"
        await say(ws, "Hello.", max_tokens=4)
        for frame, code in [
            ({"type": "edit", "seq": 7, "content": "x"}, "unknown_seq"),
            ({"type": "edit", "seq": 1, "content": "x"}, "bad_seq"),  # a reply
            ({"type": "edit", "seq": -1, "content": "x"}, "bad_seq"),
            ({"type": "edit", "seq": "0", "content": "x"}, "bad_seq"),
            ({"type": "edit", "content": "x"}, "bad_seq"),
            ({"type": "edit", "seq": 0, "content": "  "}, "bad_content"),
            ({"type": "regenerate", "max_tokens": 0}, "bad_sampling"),
        ]:
            await ws.send(json.dumps(frame))
            err = await recv(ws)
            assert err["type"] == "error" and err["code"] == code, (frame, err)
        # Busy while a reply streams.
        await ws.send(
            json.dumps({"type": "message", "content": "Count to fifty.", "max_tokens": 60})
        )
        assert (await recv(ws))["type"] == "token"
        await ws.send(json.dumps({"type": "regenerate"}))
        while (frame := await recv(ws))["type"] == "token":
            pass
        assert frame["type"] == "error" and frame["code"] == "busy"
        await ws.send(json.dumps({"type": "cancel"}))
        await until_done(ws)
        # Still usable, and nothing was cut by the refusals.
        r = await say(ws, "Bye.", max_tokens=4)
        assert r.errors == []
    assert [role for _, role, _ in history(server, token, cid)] == ["user", "assistant"] * 3


def test_rename_is_owner_checked(server, token):
    cid = server.new_chat(token, title="old")
    url = f"{server.url}/api/conversations/{cid}"
    r = httpx.patch(url, json={"title": "  new   name "}, headers=auth(token))
    assert r.status_code == 200 and r.json()["title"] == "new name"
    assert server.chat(token, cid)["title"] == "new name"
    stranger = server.user("stranger")
    assert httpx.patch(url, json={"title": "mine"}, headers=auth(stranger)).status_code == 403
    assert httpx.patch(url, json={"title": "mine"}).status_code == 401
    for body in (
        {"title": " "},
        {"title": 3},
        {},
        {"title": "x", "owner": "y"},
        {"title": "x" * 201},
    ):
        assert httpx.patch(url, json=body, headers=auth(token)).status_code == 400, body
    missing = f"{server.url}/api/conversations/nope"
    assert httpx.patch(missing, json={"title": "x"}, headers=auth(token)).status_code == 404
    assert server.chat(token, cid)["title"] == "new name"
