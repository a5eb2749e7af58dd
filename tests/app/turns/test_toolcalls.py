"""Tool calls as text: parsing, the canonical form a resent chat is compared in, the stream
splitter, the forcing grammar and the fallback rendering (units, no server)."""

from __future__ import annotations

import copy
import json

import llguidance
import llguidance.hf
import pytest

from app.openai.tools import CallStream, FunctionDef, NamedChoice, check, forcing_guide
from app.turns import toolcalls
from app.turns.prompt import chat_messages, render, text_of
from app.turns.toolcalls import Call, canonical, parse, reply_text
from engine.model.loader import _bundled_tokenizer

WEATHER = FunctionDef(
    name="get_weather",
    description="The weather in a city.",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
)
TIME = FunctionDef(name="get_time", parameters={"type": "object", "properties": {}})


@pytest.fixture(scope="module")
def tok():
    return _bundled_tokenizer(None)


def test_parse_reads_calls_and_content():
    text = 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    text += '\n<tool_call>{"name":"g","arguments":"{\\"b\\": [2]}"}</tool_call>'
    content, calls = parse(text)
    assert content == "Let me look."
    assert calls == [Call("f", {"a": 1}), Call("g", {"b": [2]})]


@pytest.mark.parametrize(
    "text",
    [
        "no calls at all",
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": {}}',  # never closed
    ],
)
def test_text_that_is_not_a_call_stays_text(text):
    assert parse(text) == (text, [])
    assert canonical(text) == text


def test_canonical_form_ignores_the_models_whitespace():
    loose = '<tool_call>{"name":"f",  "arguments":{"a":1}}</tool_call>'
    assert canonical(loose) == reply_text(None, [Call("f", {"a": 1})])
    assert canonical(canonical(loose)) == canonical(loose)
    assert toolcalls.as_sent("user", loose) == loose  # only replies hold calls


def test_call_stream_holds_a_call_until_it_closes():
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": "<x>"}}\n</tool_call>\n'
    text += '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    for size in (1, 3, 7, len(text)):
        s, out = CallStream(), []
        for i in range(0, len(text), size):
            out += s.push(text[i : i + size])
        out += s.flush()
        content = "".join(x for x in out if isinstance(x, str))
        assert content == "Sure.\n"
        assert [x for x in out if isinstance(x, Call)] == [Call("f", {"a": "<x>"}), Call("g", {})]


def test_call_stream_passes_lookalikes_on_as_text():
    s = CallStream()
    out = s.push("a <tool_ b <tool_call>oops</tool_call> c <tool") + s.flush()
    assert "".join(out) == "a <tool_ b <tool_call>oops</tool_call> c <tool"


def test_tool_checks():
    check([WEATHER, TIME], NamedChoice(type="function", function={"name": "get_time"}))
    with pytest.raises(ValueError, match="unique"):
        check([WEATHER, WEATHER], "auto")
    with pytest.raises(ValueError, match="no tool is named"):
        check([WEATHER], NamedChoice(type="function", name="nope"))
    with pytest.raises(ValueError, match="needs tools"):
        check([], "required")
    with pytest.raises(ValueError):
        FunctionDef(name="f", parameters={"type": "array"})
    with pytest.raises(ValueError, match="JSON schema"):
        FunctionDef(name="f", parameters={"type": "object", "properties": 3})


def _walk(tok, guide, pick) -> str:
    """Follow the grammar, choosing among the allowed tokens with `pick`, to its end."""
    lt = llguidance.hf.from_tokenizer(tok)
    m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_lark(guide.source))
    assert not m.is_error(), m.get_error()
    out: list[int] = []
    while len(out) < 200:
        mask = m.compute_bitmask()
        allowed = [t for t in range(len(mask) * 8) if mask[t // 8] >> (t % 8) & 1]
        if tok.eos_token_id in allowed:
            break
        t = pick(allowed)
        assert m.consume_token(t)
        out.append(t)
    return tok.decode(out)


def test_forcing_grammar_writes_canonical_calls(tok):
    assert forcing_guide([WEATHER], "auto", True) is None
    assert forcing_guide([WEATHER], "none", True) is None
    named = forcing_guide([WEATHER, TIME], NamedChoice(type="function", name="get_weather"), True)
    quote = {t for t in range(len(tok)) if '"' in tok.decode([t])}

    def short(allowed):  # end strings soon
        return next((t for t in allowed if t in quote), allowed[len(allowed) // 2])

    text = _walk(tok, named, short)
    content, calls = parse(text)
    assert content is None and [c.name for c in calls] == ["get_weather"]
    assert isinstance(calls[0].arguments["city"], str)
    assert canonical(text) == text  # what the grammar writes needs no rewriting
    required = forcing_guide([WEATHER, TIME], "required", True)
    text = _walk(tok, required, short)
    assert parse(text)[1] and canonical(text) == text


def test_fallback_lists_tools_and_wraps_results(tok):
    assert not toolcalls.takes_tools(tok)  # the bundled model's template has no tools
    spec = WEATHER.spec()
    call = reply_text(None, [Call("get_weather", {"city": "Oslo"})])
    msgs = chat_messages("Be brief.", [("user", "Weather?"), ("assistant", call)], "12 C", "tool")
    text = text_of(render(tok, msgs, [spec]))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(spec) in text
    assert "<|im_start|>user\n<tool_response>\n12 C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


# A tools-aware template in the shape of Qwen2.5's (its tool parts, shortened).
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{{ messages[0]['content'] if messages[0]['role'] == 'system' else '' }}"
    "\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    '{%- for c in m.tool_calls or [] %}<tool_call>\n{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n'
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- endif %}{%- endfor %}<|im_start|>assistant\n"
)


def test_a_template_that_takes_tools_renders_them_itself(tok):
    native = copy.copy(tok)
    native.chat_template = TOOLS_TEMPLATE
    assert toolcalls.takes_tools(native)
    spec = WEATHER.spec()
    call = reply_text("Checking.", [Call("get_weather", {"city": "Oslo"})])
    msgs = chat_messages("Be brief.", [("user", "Weather?"), ("assistant", call)], "12 C", "tool")
    text = text_of(render(native, msgs, [spec]))
    assert "# Tools" not in text  # not the fallback: the template listed them
    assert json.dumps(spec["function"]["parameters"]["properties"]) in text
    assert (
        '<|im_start|>assistant\nChecking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
        in text
    )
    assert "<tool_response>\n12 C\n</tool_response>" in text
