"""Stream resume: a chat socket that goes away mid-reply, and a new one for the same chat
that takes the reply over (a `resume` frame with the text so far, then the rest), on a real
server with the bundled model. Greedy, so the resumed reply must equal an uninterrupted
one to the character."""

from __future__ import annotations

import asyncio
import json

import pytest
import websockets

from tests.app_fixtures import TINY, Reply, connect, recv, say, server_on, until_done

pytestmark = pytest.mark.timeout(300)

ASK = "Write a long story about a lighthouse keeper and a storm."
N = 200  # tokens: long enough to be cut mid-way on any machine


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = {**TINY, "PENSIEVE_TURNS_PER_MINUTE": "1000", "PENSIEVE_RESUME_GRACE_S": "20"}
    with server_on("sqlite", tmp_path_factory.mktemp("resume"), env) as srv:
        yield srv


@pytest.fixture(scope="module")
def token(server):
    return server.user("alice")


@pytest.fixture(scope="module")
def uninterrupted(server, token) -> Reply:
    async def run() -> Reply:
        async with connect(server, server.new_chat(token), token) as ws:
            r = await say(ws, ASK, max_tokens=N)
        assert r.errors == [] and r.done["usage"]["completion_tokens"] > 20
        return r

    return asyncio.run(run())


async def start(ws, pieces: int = 3) -> str:
    """Send the question; the first `pieces` token frames' text."""
    await ws.send(json.dumps({"type": "message", "content": ASK, "max_tokens": N}))
    got = []
    while len(got) < pieces:
        frame = await recv(ws)
        assert frame["type"] == "token", frame
        got.append(frame["text"])
    return "".join(got)


async def resumed(ws) -> tuple[str, dict]:
    """The first frame is `resume`; its text and the rest of the stream make the reply."""
    first = await recv(ws)
    assert first["type"] == "resume", first
    rest = await until_done(ws)
    assert rest.errors == []
    return first["text"] + rest.text, rest.done


def stored_reply(server, token, cid) -> dict:
    msgs = server.chat(token, cid)["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant"]
    return msgs[1]


async def test_reconnect_after_a_drop_resumes_the_reply(server, token, uninterrupted):
    cid = server.new_chat(token)
    async with connect(server, cid, token) as ws:
        before = await start(ws)
    await asyncio.sleep(0.3)  # the client is gone a while; the reply goes on
    async with connect(server, cid, token) as ws:
        text, done = await resumed(ws)
    assert text.startswith(before) and len(text) > len(before)
    want = uninterrupted.done
    assert done["finish_reason"] == want["finish_reason"] != "cancelled"
    assert done["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    assert text == uninterrupted.text
    stored = stored_reply(server, token, cid)
    assert stored["content"] == text and stored["finish_reason"] == want["finish_reason"]


async def test_a_newer_socket_takes_over_from_an_open_one(server, token, uninterrupted):
    cid = server.new_chat(token)
    async with connect(server, cid, token) as old:
        before = await start(old)
        async with connect(server, cid, token) as new:
            text, done = await resumed(new)
            with pytest.raises(websockets.ConnectionClosed) as closed:
                while True:  # tokens sent before the takeover, then the close
                    assert (await recv(old, timeout=10))["type"] == "token"
            assert closed.value.rcvd.code == 4409
            # The new socket owns the chat now: a second message while none runs is fine,
            # and a cancel from it reaches its own turn.
            again = await say(new, "Thanks.", max_tokens=4)
            assert again.errors == []
    assert text.startswith(before) and text == uninterrupted.text
    assert done["finish_reason"] == uninterrupted.done["finish_reason"]
