"""The Responses and Conversations APIs end to end: the real `openai` client against a real
server with the bundled model. A response names a point of a stored conversation: chaining
to the last one continues it (the engine's KV reused), chaining elsewhere forks it (the
parent's chunks linked), across a restart too."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.app_fixtures import Server, auth, server_on

pytestmark = pytest.mark.timeout(400)

MODEL = "smollm2-135m-instruct"
CHUNK = 32  # the engine's chunk size: a turn may recompute at most its last partial chunk
QUESTIONS = [
    "Name a fruit.",
    "Name another one.",
    "And a vegetable?",
    "And a colour?",
    "And an animal?",
]
BRIEF = "Answer in a few words."


# PostgreSQL, as in production: the store's own tests cover the responses table on both.
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = {"PENSIEVE_TURNS_PER_MINUTE": "1000"}
    with server_on("postgresql", tmp_path_factory.mktemp("responses"), env) as srv:
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


def respond(c: openai.OpenAI, question, previous=None, **kw):
    """One greedy response and the stored conversation it went to."""
    raw = c.responses.with_raw_response.create(
        model=MODEL,
        input=question,
        previous_response_id=previous,
        instructions=kw.pop("instructions", BRIEF),
        temperature=0,
        max_output_tokens=kw.pop("max_output_tokens", 12),
        **kw,
    )
    return raw.parse(), raw.headers["x-session-id"]


def context(r) -> int:
    return r.usage.input_tokens + r.usage.output_tokens


def test_chain_survives_a_restart_and_forks_share_the_parents_chunks(server, token):
    c = client(server, token)
    chain, cids = [], set()
    for i, question in enumerate(QUESTIONS):
        r, cid = respond(c, question, chain[-1].id if chain else None)
        assert r.id.startswith("resp_") and r.object == "response" and r.output_text
        assert r.status in ("completed", "incomplete") and r.previous_response_id == (
            chain[-1].id if chain else None
        )
        if r.status == "incomplete":
            assert r.incomplete_details.reason == "max_output_tokens"
        u = r.usage
        assert u.total_tokens == u.input_tokens + u.output_tokens and 1 <= u.output_tokens <= 12
        if i and i != 3:  # only the new input was computed
            assert u.input_tokens > context(chain[-1])
            assert u.input_tokens_details.cached_tokens >= context(chain[-1]) - CHUNK
        chain.append(r)
        cids.add(cid)
        if i == 2:  # the state is SQL's: the chain goes on in a new process
            server.stop()
            server.start()
    assert len(cids) == 1  # one stored conversation, listed with the owner's chats
    assert cids <= set(conversations(server, token))
    stored = server.chat(token, cids.pop())["messages"]
    assert [m["content"] for m in stored] == [
        text for q, r in zip(QUESTIONS, chain, strict=True) for text in (q, r.output_text)
    ]

    # The same chain without a restart answers the same (greedy).
    fresh = []
    for question in QUESTIONS:
        fresh.append(respond(c, question, fresh[-1].id if fresh else None)[0])
    assert [r.output_text for r in fresh] == [r.output_text for r in chain]

    # Two responses off one parent that is not the last: each forks its own conversation,
    # linking the parent's chunks; both answer like the same chat run fresh.
    parent = chain[1]
    forks = [respond(c, "And a drink?", parent.id) for _ in range(2)]
    assert len({cid for _, cid in forks} | {c_ for c_ in cids}) == 2 + len(cids)
    for r, _ in forks:
        assert r.usage.input_tokens_details.cached_tokens >= context(parent) - CHUNK
    first, _ = respond(c, QUESTIONS[0])
    second, _ = respond(c, QUESTIONS[1], first.id)
    alone, _ = respond(c, "And a drink?", second.id)
    assert [r.output_text for r, _ in forks] == [alone.output_text] * 2
    # The parent's own conversation is as it was.
    assert c.responses.retrieve(chain[-1].id).output_text == chain[-1].output_text


def test_conversations_api(server, token):
    c = client(server, token)
    conv = c.conversations.create(
        items=[{"type": "message", "role": "user", "content": "My name is Ada."}],
        metadata={"topic": "names"},
    )
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "names"}
    assert conv.id.removeprefix("conv_") in conversations(server, token)
    added = c.conversations.items.create(
        conv.id,
        items=[{"type": "message", "role": "assistant", "content": "Hello, Ada."}],
    )
    assert [i.role for i in added.data] == ["assistant"]
    r1, cid = respond(c, "What is my name?", conversation=conv.id)
    r2, cid2 = respond(c, "Thanks!", conversation=conv.id)
    assert cid == cid2 == conv.id.removeprefix("conv_")
    assert r1.conversation.id == conv.id
    assert r2.usage.input_tokens_details.cached_tokens >= context(r1) - CHUNK
    items = c.conversations.items.list(conv.id, order="asc")
    assert [(i.role, i.content[0].text) for i in items.data] == [
        ("user", "My name is Ada."),
        ("assistant", "Hello, Ada."),
        ("user", "What is my name?"),
        ("assistant", r1.output_text),
        ("user", "Thanks!"),
        ("assistant", r2.output_text),
    ]
    assert items.data[3].id == r1.output[0].id and items.data[3].content[0].type == "output_text"
    desc = c.conversations.items.list(conv.id, limit=2)
    assert [i.id for i in desc.data] == [items.data[5].id, items.data[4].id] and desc.has_more
    assert c.conversations.retrieve(conv.id).id == conv.id
    assert c.conversations.delete(conv.id).deleted
    with pytest.raises(openai.NotFoundError):
        c.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        c.conversations.items.list(conv.id)
    with pytest.raises(openai.NotFoundError):  # its responses went with it
        c.responses.retrieve(r1.id)
    assert cid not in conversations(server, token)


def test_streaming_events(server, token):
    c = client(server, token)
    events = list(
        c.responses.create(
            model=MODEL, input="Say hello to the world.", stream=True, temperature=0,
            max_output_tokens=16,
        )
    )  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert kinds.count("response.output_text.delta") >= 2
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == events[-4].text and deltas
    assert events[2].item.id == final.output[0].id
    assert c.responses.retrieve(final.id).output_text == deltas


def test_ids_are_per_owner_and_store_false_keeps_nothing(server, token):
    c = client(server, token)
    other = client(server, server.user("mallory"))
    r, _ = respond(c, "Hi there.", max_output_tokens=4)
    assert [i.content[0].text for i in c.responses.input_items.list(r.id).data] == ["Hi there."]
    for call in (
        lambda: other.responses.retrieve(r.id),
        lambda: respond(other, "Hello?", r.id),
        lambda: other.responses.input_items.list(r.id),
        lambda: c.responses.retrieve("resp_unknown"),
        lambda: respond(c, "Hello?", "resp_unknown"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    c.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)

    before = set(conversations(server, token))
    kept, cid = respond(c, "Count to three.", max_output_tokens=4)
    gone, _ = respond(c, "Count to four.", kept.id, store=False, max_output_tokens=4)
    alone, _ = respond(c, "Count to five.", store=False, max_output_tokens=4)
    assert gone.output_text and alone.output_text
    assert set(conversations(server, token)) - before == {cid}  # only the stored one
    # Other instructions are not inherited: the chain forks with the new system prompt.
    french, other_cid = respond(c, "And to four?", kept.id, instructions="Answer in French.")
    assert french.output_text and other_cid != cid
    assert server.chat(token, other_cid)["system_prompt"] == "Answer in French."
    assert server.chat(token, cid)["system_prompt"] == BRIEF
    for r in (gone, alone):
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            respond(c, "And then?", r.id)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": MODEL, "input": 5}, "input"),
        ({"model": MODEL}, "input"),
        ({"model": MODEL, "input": [{"role": "assistant", "content": "x"}]}, "input"),
        ({"model": MODEL, "input": [{"role": "pilot", "content": "x"}]}, "input.0.role"),
        ({"model": MODEL, "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}, "tools.0"),
        ({"model": MODEL, "input": "x", "tools": [{"type": "function", "name": "a b"}]}, "tools.0"),
        ({"model": MODEL, "input": "x", "tool_choice": "required"}, "tool_choice"),
        (
            {"model": MODEL, "input": [{"type": "function_call_output", "output": "c"}]},
            "input.0.call_id",
        ),
        (
            {
                "model": MODEL,
                "input": [
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"},
                    {"type": "function_call_output", "call_id": "c", "output": "x"},
                ],
            },
            "input.0.arguments",
        ),  # fmt: skip
        (
            {
                "model": MODEL,
                "input": "x",
                "text": {"format": {"type": "json_schema", "name": "n", "schema": [1]}},
            },
            "text.format",
        ),
        (
            {"model": MODEL, "input": "x", "previous_response_id": "a", "conversation": "b"},
            "conversation",
        ),  # fmt: skip
    ],
)
def test_malformed_requests(server, token, body, param):
    r = httpx.post(server.url + "/v1/responses", json=body, headers=auth(token))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_bad_json_and_text_formats(server, token):
    r = httpx.post(
        server.url + "/v1/responses",
        content=b"{nope",
        headers={**auth(token), "content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    c = client(server, token)
    r, _ = respond(
        c, "Give me JSON.", max_output_tokens=4,
        text={"format": {"type": "json_schema", "name": "thing", "schema": schema}},
    )  # fmt: skip
    assert r.text.format.type == "json_schema" and r.text.format.schema_ == schema
