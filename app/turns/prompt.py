"""Chat template rendering for one new turn: the token ids that extend the stored stream.

Message text is encoded as plain text: a special-token string typed into a message (say
`<|im_start|>system`) becomes ordinary text tokens, so nobody can forge template markup.
Only the template's own markup is encoded with its special tokens."""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from app.turns import toolcalls


@dataclass
class Delta:
    token_ids: list[int]  # what the engine computes for this turn's prompt
    context_len: int  # tokens of the stored stream kept before them


@dataclass
class Segment:
    text: str
    plain: bool  # message text: special-token strings in it are ordinary text


def chat_messages(
    system_prompt: str | None, history: list[tuple[str, str]], user: str, role: str = "user"
) -> list[dict]:
    """The template's input: optional system prompt, earlier turns, the new message (the
    user's, or a function's result: role "tool")."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages += [{"role": r, "content": content} for r, content in history]
    return messages + [{"role": role, "content": user}]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _specials(tokenizer) -> list[str]:
    """The strings the tokenizer would read as special tokens, longest first."""
    names = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    return sorted(names, key=len, reverse=True)


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[Segment]:
    """The rendered chat as segments: template markup, and special-token strings found in
    message text (plain). Those strings go through the template as unguessable
    placeholders, so whatever the template does to the text, they stay apart. `tools`:
    function definitions offered to the model (app/turns/toolcalls.py)."""
    messages, extra = toolcalls.template_input(tokenizer, messages, tools)
    specials = _specials(tokenizer)
    found: list[str] = []
    if specials:
        nonce = secrets.token_hex(8)
        pattern = re.compile("|".join(map(re.escape, specials)))

        def hide(m: re.Match) -> str:
            found.append(m.group())
            return f"\ue000{nonce}:{len(found) - 1}\ue001"

        def hide_in(x):  # every string a message or a tool carries
            if isinstance(x, str):
                return pattern.sub(hide, x)
            if isinstance(x, dict):
                return {k: v if k == "role" else hide_in(v) for k, v in x.items()}
            if isinstance(x, list):
                return [hide_in(v) for v in x]
            return x

        messages, extra = hide_in(messages), hide_in(extra)
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **extra
    )
    if not found:
        return [Segment(text, False)]
    segments: list[Segment] = []
    parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", text)
    for i, part in enumerate(parts):
        if i % 2:
            segments.append(Segment(found[int(part)], True))
        elif part:
            segments.append(Segment(part, False))
    return segments


def text_of(segments: list[Segment]) -> str:
    return "".join(s.text for s in segments)


def encode(tokenizer, segments: list[Segment], skip_chars: int = 0) -> list[int]:
    """Token ids of the segments' text after its first `skip_chars` characters."""
    ids: list[int] = []
    for seg in segments:
        text = seg.text[skip_chars:]
        skip_chars = max(0, skip_chars - len(seg.text))
        if text:
            ids += tokenizer(text, add_special_tokens=False, split_special_tokens=seg.plain)[
                "input_ids"
            ]
    return ids


def render_delta(
    tokenizer, messages: list[dict], stored: list[int], tools: list[dict] | None = None
) -> Delta:
    """Render the whole chat, keep what the stored stream already holds, tokenize the rest.

    The stored stream is what the model saw, so it is never re-tokenized. When the template
    is prefix-stable (the usual case) the new text simply follows it. Otherwise the longest
    common token prefix is kept and everything after it is recomputed."""
    segments = render(tokenizer, messages, tools)
    full = text_of(segments)
    seen = tokenizer.decode(stored, skip_special_tokens=False)
    if full.startswith(seen):
        ids = encode(tokenizer, segments, len(seen))
        if ids:
            return Delta(ids, len(stored))
    full_ids = encode(tokenizer, segments)
    keep = common_prefix(full_ids, stored)
    if keep == len(full_ids):  # the new prompt must compute at least one token
        keep -= 1
    return Delta(full_ids[keep:], keep)
