"""Thinking replies keep the cache: with a Qwen3-shaped chat template (earlier replies
rendered without their thinking: bench/samples/thinking.jinja on the bundled model), a reply
is re-encoded as the template renders it in history when it ends, so each turn reuses the
whole history before the last reply, through the socket, /v1/chat/completions and
/v1/responses. PostgreSQL and a real Redis, as in production."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import websockets
from transformers import AutoTokenizer

from bench.lib import harness
from engine.model.loader import convert_bundled
from tests import services
from tests.app_fixtures import Server, auth, server_on, until_done

pytestmark = pytest.mark.timeout(600)

MODEL = "smollm2-135m-instruct"
TEMPLATE = harness.ROOT / "bench" / "samples" / "thinking.jinja"
BRIEF = "Answer in a few words."
QUESTIONS = ["Name a fruit.", "Name another one.", "And a vegetable?", "A colour?", "An animal?"]
CHUNK = 32  # the engine's chunk size
MAX = 48  # room for the small model to end its replies itself (a cut reply is not re-encoded)


@pytest.fixture(scope="module")
def redis_server():
    server = services.RedisServer().start()
    yield server
    server.kill()


def serve(tmp, redis_server, **env):
    env = {
        "PENSIEVE_CHAT_TEMPLATE": str(TEMPLATE),
        "PENSIEVE_REDIS_URL": redis_server.url,
        "PENSIEVE_TURNS_PER_MINUTE": "1000",
        "PENSIEVE_MAX_TOKENS_DEFAULT": str(MAX),
        **env,
    }
    return server_on("postgresql", tmp, env)


@pytest.fixture(scope="module")
def server(redis_server, tmp_path_factory):
    with serve(tmp_path_factory.mktemp("thinking"), redis_server) as srv:
        yield srv
    assert "Traceback" not in srv.log_tail(100_000)


@pytest.fixture(scope="module")
def thought() -> int:
    """Tokens of the thought the template's generation prompt opens: the history renders
    neither it nor the reply's own thinking, so both are computed again."""
    tok = AutoTokenizer.from_pretrained(convert_bundled(None))
    tok.chat_template = TEMPLATE.read_text()
    msgs = [{"role": "user", "content": "x"}]
    gen = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    base = tok.apply_chat_template(msgs, tokenize=False) + "<|im_start|>assistant\n"
    return len(tok(gen[len(base) :], add_special_tokens=False)["input_ids"])


def metric(server: Server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


_CHATS: dict[str, list[dict]] = {}  # the module server's chat, run once for two tests


async def chat_on(server: Server) -> list[dict]:
    if server.url not in _CHATS:
        _CHATS[server.url] = await socket_chat(server)
    return _CHATS[server.url]


async def socket_chat(server: Server) -> list[dict]:
    token = server.user("socket")
    cid = server.new_chat(token, system_prompt=BRIEF)
    frames = []
    headers = auth(token)
    async with websockets.connect(server.ws + cid, additional_headers=headers) as ws:
        for q in QUESTIONS:
            await ws.send(json.dumps({"type": "message", "content": q, "temperature": 0}))
            reply = await until_done(ws)
            assert not reply.errors
            frames.append({**reply.done, "text": reply.text})
    return frames


async def test_a_five_turn_thinking_chat_reuses_all_but_the_last_reply(server, thought):
    frames = await chat_on(server)
    total = 0  # the context after the previous turn
    for i, f in enumerate(frames):
        u = f["usage"]
        reused = u["cached_tokens"] + u["swapped_in_tokens"] + u["recomputed_tokens"]
        if i:
            last = frames[i - 1]
            assert last["finish_reason"] == "stop"
            # cut back where the reply's turn opened: the history before it is reused ...
            assert reused == total - last["usage"]["completion_tokens"] - thought
            # ... from the cache, but for a chunk shared with other chats that the cut
            # falls in, which is recomputed (a shared chunk is never written)
            assert u["cached_tokens"] + u["swapped_in_tokens"] >= reused - CHUNK
        if f["finish_reason"] == "stop":
            assert 0 < u["reencoded_tokens"] <= u["completion_tokens"]
        tail = frames[i - 1]["usage"]["reencoded_tokens"] if i else 0
        total = reused + tail + u["prompt_tokens"] + u["completion_tokens"]
    assert metric(server, "pensieve:reencoded_tokens") >= sum(
        f["usage"]["reencoded_tokens"] for f in frames
    )
    r = httpx.get(server.url + "/api/admin/cache", headers=auth(server.admin_token))
    assert r.json()["counters"]["reencoded_tokens"] >= frames[0]["usage"]["reencoded_tokens"]


def test_chat_completions_reuse_all_but_the_last_reply(server, thought):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=server.user("api"), max_retries=0)
    messages = [{"role": "system", "content": BRIEF}]
    context = completion = 0
    cids = set()
    for i, q in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": q})
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=MAX, temperature=0
        )
        r = raw.parse()
        cids.add(raw.headers["x-session-id"])
        u = r.usage
        if i:
            assert u.prompt_tokens_details.cached_tokens >= context - completion - thought - CHUNK
        assert r.choices[0].finish_reason == "stop"
        context, completion = u.prompt_tokens + u.completion_tokens, u.completion_tokens
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    assert len(cids) == 1  # the resent chat found its conversation every turn


def test_responses_reuse_all_but_the_last_reply(server, thought):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=server.user("resp"), max_retries=0)
    previous = None
    context = completion = 0
    for i, q in enumerate(QUESTIONS):
        r = c.responses.create(
            model=MODEL,
            input=q,
            instructions=BRIEF,
            previous_response_id=previous,
            temperature=0,
            max_output_tokens=MAX,
        )
        u = r.usage
        if i:
            assert u.input_tokens_details.cached_tokens >= context - completion - thought - CHUNK
        assert r.status == "completed"
        context, completion, previous = u.input_tokens + u.output_tokens, u.output_tokens, r.id


async def test_without_reencoding_the_replies_are_the_same(server, redis_server, tmp_path):
    """reencode_replies off: nothing is re-encoded, and the chat says the same (the next
    turn cuts the stream back where the reply started and renders the rest instead)."""
    on = await chat_on(server)
    with serve(tmp_path, redis_server, PENSIEVE_REENCODE_REPLIES="false") as off_server:
        off = await socket_chat(off_server)
        assert metric(off_server, "pensieve:reencoded_tokens") == 0
    assert [f["text"] for f in off] == [f["text"] for f in on]
    assert all(f["usage"]["reencoded_tokens"] == 0 for f in off)
