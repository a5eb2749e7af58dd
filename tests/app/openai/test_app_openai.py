"""The OpenAI-compatible API end to end: the real `openai` client against a real server
with the bundled model; every turn lands in the same stateful conversations as the socket."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from app.turns.stops import StopMatcher
from tests.app_fixtures import TINY, Server, auth, server_on, wait_for

pytestmark = pytest.mark.timeout(300)

MODEL = "smollm2-135m-instruct"
CHUNK = 32  # the engine's chunk size: a turn may recompute at most its last partial chunk


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server(request, tmp_path_factory):
    env = {**TINY, "PENSIEVE_TURNS_PER_MINUTE": "1000"}
    with server_on(request.param, tmp_path_factory.mktemp("openai"), env) as srv:
        yield srv
    assert "Traceback" not in srv.log_tail(100_000)


@pytest.fixture(scope="module")
def token(server):
    return server.user("alice")


def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def conversations(server: Server, key: str) -> list[str]:
    r = httpx.get(server.url + "/api/conversations", headers=auth(key))
    return [c["id"] for c in r.json()["conversations"]]


def ask(c: openai.OpenAI, messages: list[dict], **kw):
    """One completion and the conversation it went to."""
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=kw.pop("max_tokens", 8), temperature=0, **kw
    )
    return raw.parse(), raw.headers["x-session-id"]


def test_models_list(server, token):
    assert [m.id for m in client(server, token).models.list()] == [MODEL]


def test_models_report_the_context_length_and_version(server, token):
    """As vLLM's do: benchmark clients read the context length and ask /version first."""
    models = httpx.get(server.url + "/v1/models", headers=auth(token)).json()["data"]
    gpu_tier = int(TINY["PENSIEVE_GPU_CACHE_CHUNKS"]) * CHUNK  # one chat must fit it
    assert models[0]["id"] == MODEL and gpu_tier - CHUNK < models[0]["max_model_len"] < gpu_tier
    r = httpx.get(server.url + "/version")
    assert r.status_code == 200 and r.json()["version"]


def test_vllm_sampling_extensions(server, token):
    """ignore_eos generates max_tokens whatever the model would say; top_k is accepted."""
    c = client(server, token)
    out = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say yes."}],
        max_tokens=40,
        temperature=0.7,
        seed=1,
        extra_body={"ignore_eos": True, "top_k": 5},
    )
    assert out.usage.completion_tokens == 40
    assert out.choices[0].finish_reason == "length"


def test_three_turns_reuse_the_context(server, token):
    c = client(server, token)
    messages = [{"role": "user", "content": "Name a fruit."}]
    before = set(conversations(server, token))
    seen, context = set(), 0
    for turn, question in enumerate(["", "Name another one.", "And a vegetable?"]):
        if question:
            messages.append({"role": "user", "content": question})
        r, cid = ask(c, messages)
        seen.add(cid)
        u = r.usage
        assert r.object == "chat.completion" and r.choices[0].finish_reason in ("stop", "length")
        assert 1 <= u.completion_tokens <= 8
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
        if turn:  # the whole earlier context is reused, not recomputed
            assert u.prompt_tokens > context
            assert u.prompt_tokens_details.cached_tokens >= context - CHUNK
        context = u.prompt_tokens + u.completion_tokens
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    assert len(seen) == 1 and set(conversations(server, token)) - before == seen
    stored = server.chat(token, cid)["messages"]
    assert [(m["role"], m["content"]) for m in stored] == [
        (m["role"], m["content"]) for m in messages
    ]


def test_streaming_with_usage(server, token):
    c = client(server, token)
    messages = [{"role": "user", "content": "Say hello to the world."}]
    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) >= 2
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finish[-1] in ("stop", "length") and all(f is None for f in finish[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and 1 <= usage.completion_tokens <= 12
    # The streamed reply is what was stored, and the next turn continues that conversation.
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Thanks!"}]
    r, _ = ask(c, messages, max_tokens=4)
    context = usage.prompt_tokens + usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= context - CHUNK


def test_stop_strings_cut_the_reply(server, token):
    c = client(server, token)
    messages = [{"role": "user", "content": "List the numbers from 1 to 20, comma separated."}]
    r, cid = ask(c, messages, max_tokens=40, stop=["7"])
    text = r.choices[0].message.content
    assert "7" not in text and r.choices[0].finish_reason == "stop"
    assert server.chat(token, cid)["messages"][-1]["content"] == text
    # The cut reply is part of the chat the client sends back: the same conversation goes on.
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on."}]
    _, again = ask(c, messages, max_tokens=4)
    assert again == cid


def test_an_edited_history_cuts_the_conversation_back(server, token):
    c = client(server, token)
    messages = [{"role": "user", "content": "What colour is the sky?"}]
    r1, cid = ask(c, messages)
    messages.append({"role": "assistant", "content": r1.choices[0].message.content})
    ask(c, [*messages, {"role": "user", "content": "And the grass?"}])
    # The client rewrites its second question: the conversation drops the old second turn.
    r3, again = ask(c, [*messages, {"role": "user", "content": "And the sea?"}])
    assert again == cid
    first_context = r1.usage.prompt_tokens + r1.usage.completion_tokens
    assert r3.usage.prompt_tokens_details.cached_tokens >= first_context - CHUNK
    stored = [(m["role"], m["content"]) for m in server.chat(token, cid)["messages"]]
    assert stored[:3] == [
        ("user", "What colour is the sky?"),
        ("assistant", r1.choices[0].message.content),
        ("user", "And the sea?"),
    ]
    assert len(stored) == 4 and stored[3][1] == r3.choices[0].message.content


def test_errors_in_openai_shape(server, token):
    user = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.AuthenticationError):
        client(server, "not-a-key").chat.completions.create(model=MODEL, messages=user)
    with pytest.raises(openai.AuthenticationError):
        client(server, "not-a-key").models.list()
    c = client(server, token)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[])
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=user, temperature=5)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=user, n=2)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=user, stop=["a", "b", "c", "d", "e"])
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=[{"role": "assistant", "content": "x"}])
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4o", messages=user)
    assert e.value.code == "model_not_found"
    # A context over the model's limit (the tiny pools hold 767 tokens): refused, no chat kept.
    before = conversations(server, token)
    long = [{"role": "user", "content": "word " * 2000}]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=long, max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    assert conversations(server, token) == before


async def test_concurrent_sessions_reuse_only_their_own_kv(server, token):
    topics = ["cats", "dogs", "birds", "fish", "trees", "rivers", "stars", "boats"]
    before = set(conversations(server, token))

    async def session(topic: str, c: openai.AsyncOpenAI) -> tuple[set[str], list[dict]]:
        messages, seen, context = [], set(), 0
        for question in (f"Tell me about {topic}.", "Why?", "Thanks."):
            messages.append({"role": "user", "content": question})
            raw = await c.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, max_tokens=6, temperature=0
            )
            r = raw.parse()
            seen.add(raw.headers["x-session-id"])
            if context:
                assert r.usage.prompt_tokens_details.cached_tokens >= context - CHUNK
            context = r.usage.prompt_tokens + r.usage.completion_tokens
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
        return seen, messages

    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=token, max_retries=0) as c:
        results = await asyncio.gather(*(session(t, c) for t in topics))
    ids = [next(iter(seen)) for seen, _ in results]
    assert all(len(seen) == 1 for seen, _ in results) and len(set(ids)) == len(topics)
    assert set(conversations(server, token)) - before == set(ids)
    for cid, (_, messages) in zip(ids, results, strict=True):
        stored = [(m["role"], m["content"]) for m in server.chat(token, cid)["messages"]]
        assert stored == [(m["role"], m["content"]) for m in messages]


def test_owners_never_share_a_conversation(server, token):
    other = server.user("bob")
    messages = [{"role": "user", "content": "Tell me a secret word."}]
    r, mine = ask(client(server, token), messages)
    messages += [
        {"role": "assistant", "content": r.choices[0].message.content},
        {"role": "user", "content": "Again?"},
    ]
    _, theirs = ask(client(server, other), messages)  # identical messages, another owner
    assert theirs != mine and theirs in conversations(server, other)
    assert mine not in conversations(server, other)
    # Naming my conversation does not reach it either.
    _, named = ask(client(server, other), messages, extra_headers={"X-Session-ID": mine})
    assert named != mine
    assert len(server.chat(token, mine)["messages"]) == 2  # untouched


def test_session_id_names_a_conversation(server, token):
    c = client(server, token)
    messages = [{"role": "user", "content": "Hi there."}]
    _, a = ask(c, messages, extra_headers={"X-Session-ID": "tab-1"})
    _, b = ask(c, messages, extra_headers={"X-Session-ID": "tab-2"})
    _, a2 = ask(c, messages, extra_body={"prompt_cache_key": "tab-1"})
    _, a3 = ask(c, messages, extra_body={"session_id": "tab-1", "prompt_cache_key": "tab-2"})
    _, b2 = ask(
        c, messages, extra_headers={"X-Session-ID": "tab-2"}, extra_body={"session_id": "tab-1"}
    )
    assert a != b and a2 == a3 == a and b2 == b  # the header, then session_id, then the key
    assert len(server.chat(token, a)["messages"]) == 2  # the same question again: cut back


def test_disconnect_mid_stream_cancels_and_keeps_the_reply(server, token):
    c = client(server, token)
    stream = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Write a long story about a dragon."}],
        max_tokens=400,
        temperature=0.8,
        seed=1,
        stream=True,
        extra_headers={"X-Session-ID": "leaving"},
    )
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got == 3:
            break
    stream.close()
    cid = stream.response.headers["x-session-id"]

    def committed():
        msgs = server.chat(token, cid)["messages"]
        return msgs[-1] if msgs[-1]["role"] == "assistant" else None

    last = wait_for(committed, timeout=30)
    assert last and last["finish_reason"] == "cancelled"
    assert last["content"] and 3 <= last["tokens"] < 400


@pytest.mark.parametrize(
    ("pieces", "stops", "sent", "hit"),
    [
        (["Hello", " wor", "ld"], ["world"], "Hello ", True),
        (["ab", "c"], ["x"], "abc", False),
        (["a7", "b"], ["7"], "a", True),
        (["Hel", "lo"], ["lo!"], "Hello", False),
    ],
)
def test_stop_matcher(pieces, stops, sent, hit):
    m = StopMatcher(stops)
    out = "".join(m.push(p) for p in pieces)
    out += "" if m.hit else m.flush()
    assert (out, m.hit) == (sent, hit)
    assert m.text == sent


async def test_bench_driver_over_the_openai_api(server, token):
    """bench.serve --api openai: each turn resends the chat and reuses the stored context."""
    from bench.lib import workload as wl
    from bench.lib.drivers import OpenAIDriver

    driver = OpenAIDriver(server.url, token)
    try:
        replies = []
        for cid in ("a", "b"):
            for i, text in enumerate((f"Tell me about {cid}-sharp.", "Shorter, please.")):
                spec = wl.TurnSpec(prompt=[], output_len=5, text=text)
                replies.append(await driver.send(cid, i, spec, 0))
    finally:
        await driver.close()
    assert [r.error for r in replies] == [None] * 4
    assert all(1 <= r.output_tokens <= 5 for r in replies)
    first, second = replies[0], replies[1]
    assert second.stats["cached_tokens"] >= first.stats["prompt_tokens"] - CHUNK


async def test_busy_and_quota_429_and_chats_survive_a_restart(tmp_path):
    env = {**TINY, "PENSIEVE_TURNS_PER_MINUTE": "6"}
    env.update(PENSIEVE_MAX_RUNNING="1", PENSIEVE_MAX_WAITING="1")
    srv = Server(f"sqlite+aiosqlite:///{tmp_path}/pensieve.db", tmp_path / "server.log", env=env)
    srv.start()
    try:
        key = srv.user("carol")
        # One turn running and one queued: more are refused with 429 and a retry hint, and
        # leave no chat behind.
        async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0) as ac:
            outcomes = await asyncio.gather(
                *(
                    ac.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": f"Count to fifty, {i}."}],
                        max_tokens=48,
                    )
                    for i in range(4)
                ),
                return_exceptions=True,
            )
        busy = [o for o in outcomes if isinstance(o, openai.RateLimitError)]
        done = [o for o in outcomes if not isinstance(o, Exception)]
        assert busy and done and len(busy) + len(done) == 4
        assert all(int(b.response.headers["retry-after"]) >= 1 for b in busy)
        assert len(conversations(srv, key)) == len(done)
        c = client(srv, key)
        messages = [{"role": "user", "content": "Name a colour."}]
        r, cid = ask(c, messages)
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "Another?"},
        ]
        r2, again = ask(c, messages)
        assert again == cid
        with pytest.raises(openai.RateLimitError) as e:
            ask(c, messages)
        assert int(e.value.response.headers["retry-after"]) >= 1
        srv.kill()  # no clean shutdown: the chat is in SQL, the engine's copy is gone
        srv.start()
        r3, after = ask(client(srv, key), messages)
        assert after == cid
        assert r3.usage.prompt_tokens == r2.usage.prompt_tokens  # the same context, rebuilt
        assert len(srv.chat(key, cid)["messages"]) == 4
    finally:
        srv.stop()
    assert "Traceback" not in srv.log_tail(100_000)
