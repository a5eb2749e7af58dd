"""Tool calls through /v1/chat/completions end to end: the real `openai` client, a real
server and the bundled model (whose template has no tools: the documented fallback)."""

from __future__ import annotations

import json

import openai
import pytest

from tests.app_fixtures import TINY, server_on

pytestmark = pytest.mark.timeout(300)

MODEL = "smollm2-135m-instruct"
CHUNK = 32

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 1000},
                    "b": {"type": "integer", "minimum": 0, "maximum": 1000},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time now."}},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = {**TINY, "PENSIEVE_TURNS_PER_MINUTE": "1000"}
    with server_on("sqlite", tmp_path_factory.mktemp("tools"), env) as srv:
        yield srv
    assert "Traceback" not in srv.log_tail(100_000)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.user("tom"), max_retries=0)


def create(client, messages, **kw):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=kw.pop("max_tokens", 60), **kw
    )
    return raw.parse(), raw.headers["x-session-id"]


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def test_a_forced_call_then_its_result_continue_one_conversation(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    out, cid = create(client, messages, tools=TOOLS, tool_choice=named("get_weather"))
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    context = out.usage.prompt_tokens + out.usage.completion_tokens

    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 14}'},
    ]
    out, again = create(client, messages, tools=TOOLS, max_tokens=12)
    assert again == cid  # the same conversation: the resent call matched the stored reply
    assert out.usage.prompt_tokens_details.cached_tokens >= context - CHUNK
    assert out.choices[0].message.content


def test_required_calls_stream_as_deltas(client):
    messages = [{"role": "user", "content": "Add 2 and 3."}]
    whole, _ = create(client, messages, tools=TOOLS, tool_choice="required")
    want = [
        (c.function.name, json.loads(c.function.arguments))
        for c in whole.choices[0].message.tool_calls
    ]
    assert want and all(name in {"get_weather", "add", "get_time"} for name, _ in want)

    stream = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=60, tools=TOOLS,
        tool_choice="required", stream=True,
    )  # fmt: skip
    calls, finish, content = {}, None, ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == want


def test_one_call_when_parallel_calls_are_off(client):
    messages = [{"role": "user", "content": "Weather in Rome and in Oslo?"}]
    out, _ = create(
        client, messages, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
    )
    assert len(out.choices[0].message.tool_calls) == 1


def test_auto_and_none_leave_the_reply_free(client):
    messages = [{"role": "user", "content": "Say hello."}]
    out, _ = create(client, messages, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content


@pytest.mark.parametrize(
    "change, param",
    [
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
                ]
            },
            "tools",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": named("nope")}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ],
)
def test_malformed_tools_are_a_400(client, change, param):
    with pytest.raises(openai.BadRequestError) as e:
        create(client, [{"role": "user", "content": "Hi"}], **change)
    assert e.value.status_code == 400 and e.value.body["param"].startswith(param)


def test_a_resent_call_with_bad_arguments_is_a_400(client):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{oops"}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
    ]  # fmt: skip
    with pytest.raises(openai.BadRequestError) as e:
        create(client, messages, tools=TOOLS)
    assert "not a JSON object" in e.value.body["message"]


# --- the Responses API ------------------------------------------------------------------

FLAT = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's shape


def test_responses_call_then_output_chain_on_the_kept_context(client, server):
    first = client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=FLAT, temperature=0,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
    )  # fmt: skip
    [call] = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"]
    assert not [o for o in first.output if o.type == "message"]
    context = first.usage.input_tokens + first.usage.output_tokens

    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=FLAT, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "14 C"}],
        max_output_tokens=12,
    )  # fmt: skip
    assert second.usage.input_tokens_details.cached_tokens >= context - CHUNK
    assert second.output_text

    listed = client.responses.input_items.list(second.id)
    assert [(i.type, i.call_id) for i in listed.data] == [("function_call_output", call.call_id)]


def test_responses_stream_function_call_items(client):
    stream = client.responses.create(
        model=MODEL, input="Add 2 and 3.", tools=FLAT, tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_output_tokens=60, stream=True,
    )  # fmt: skip
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    final = [o for o in events[-1].response.output if o.type == "function_call"]
    assert len(done) == len(final) == 1
    assert done[0].arguments == final[0].arguments and done[0].item_id == final[0].id


def test_conversation_items_list_calls_and_outputs(client, server):
    conv = client.conversations.create()
    r = client.responses.create(
        model=MODEL, conversation=conv.id, input="Time?", tools=FLAT, temperature=0,
        tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=30,
    )  # fmt: skip
    [call] = [o for o in r.output if o.type == "function_call"]
    client.conversations.items.create(
        conv.id, items=[{"type": "function_call_output", "call_id": call.call_id, "output": "9"}]
    )
    items = client.conversations.items.list(conv.id, order="asc").data
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]
    assert items[1].call_id == items[2].call_id == call.call_id
