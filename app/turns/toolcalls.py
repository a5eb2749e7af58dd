"""Function calls as text in a conversation: how a reply writes them, how they are read back,
and how tools and tool results reach the chat template.

A reply calls functions in the Hermes format that Qwen2.5 and many open models are trained
on, one block per call after any text:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A model whose chat template takes `tools` (Qwen2.5, Llama 3.1) gets the tools, its calls and
the results through the template. Otherwise (the bundled SmolLM2) the documented fallback
is the same format by hand: the tools are listed in the system prompt in <tools></tools>,
each result comes back as a user message wrapped in <tool_response></tool_response>.

The stored reply is the text the model wrote; its canonical form (parsed, written back as
above) is what a client's resent copy is compared with, so whitespace the model chose does
not make a resent chat look edited."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
OPEN = "<tool_call>"

FALLBACK = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict


def call_text(call: Call) -> str:
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n</tool_call>"


def reply_text(content: str | None, calls: list[Call]) -> str:
    """A reply's canonical text: its content, then one block per call."""
    parts = [content] if content else []
    return "\n".join(parts + [call_text(c) for c in calls])


def parse(text: str) -> tuple[str | None, list[Call]]:
    """A reply's content (None when empty) and its calls. Text with a block that is not a
    call (bad JSON, no name, arguments not an object) is all content: nothing is guessed."""
    calls = []
    for m in BLOCK.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            return text, []
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return text, []
        if not isinstance(obj.get("name") if args is not None else None, str):
            return text, []
        if not isinstance(args, dict):
            return text, []
        calls.append(Call(obj["name"], args))
    if not calls:
        return text, []
    content = BLOCK.sub("", text).strip()
    return content or None, calls


def canonical(text: str) -> str:
    content, calls = parse(text)
    return reply_text(content, calls) if calls else text


def as_sent(role: str, content: str) -> str:
    """A stored message's text as a client resends it (a reply's calls in canonical form)."""
    return canonical(content) if role == "assistant" else content


def takes_tools(tokenizer) -> bool:
    """Whether the model's chat template renders `tools` itself."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def template_input(tokenizer, messages: list[dict], tools: list[dict] | None) -> tuple[list, dict]:
    """The chat template's messages and extra arguments for a chat that may hold calls and
    results, with `tools` (OpenAI function definitions) offered to the model."""
    if takes_tools(tokenizer):
        out = []
        for m in messages:
            if m["role"] == "assistant":
                content, calls = parse(m["content"])
                if calls:
                    m = {
                        "role": "assistant",
                        "content": content or "",
                        "tool_calls": [
                            {
                                "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments},
                            }
                            for c in calls
                        ],
                    }
            out.append(m)
        return out, ({"tools": tools} if tools else {})
    out = [
        {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        if m["role"] == "tool"
        else m
        for m in messages
    ]
    if tools:
        listed = FALLBACK.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{listed}"}
        else:
            out.insert(0, {"role": "system", "content": listed})
    return out, {}
