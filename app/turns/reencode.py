"""A reply as the chat template renders it in history, for templates that render earlier
replies differently from how they were generated (thinking models such as Qwen3 drop an
earlier reply's `<think>...</think>`, or the thought their generation prompt opened;
gpt-oss's harmony template keeps only an earlier reply's final channel).

Without this, the next turn's rendered history no longer starts with the stored stream, so
it is cut back at the first difference (app/turns/prompt.py). Re-encoding when the reply
ends makes the stored stream what the template will render: the next turn extends it, and
computes only the reply's re-encoded tokens again, never the history before them.

The test is general: render the chat with the reply as an earlier turn (a dummy user turn
after it) and compare its text with the stream as generated. Only this turn's own tokens
(its prompt and reply) may change; a difference earlier leaves the stream as it is."""

from __future__ import annotations

import secrets
from collections.abc import Collection
from dataclasses import dataclass

from app.turns import harmony
from app.turns.prompt import encode, render, text_of


@dataclass
class Reencoded:
    keep: int  # stream positions kept (the tokens before them rendered alike)
    token_ids: list[int]  # the rest of the turn, as the template renders it in history


def _common_chars(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def reencode(
    tokenizer,
    messages: list[dict],
    stream: list[int],
    context_len: int,
    reply: str,
    reply_ids: list[int],
    stop_ids: Collection[int],
    tools: list[dict] | None = None,
) -> Reencoded | None:
    """The turn re-encoded as its chat renders it in history; None where it renders as
    generated, or cannot be re-encoded safely (the reply did not end on a stop token, a
    difference before this turn's prompt, no end of the reply found).

    `messages`: the template input of the turn (ending with its user message); `stream`:
    the context window's tokens through the turn's prompt, the first `context_len` of them
    earlier turns'; `reply`, `reply_ids`: the reply's text and its tokens as generated."""
    if not reply_ids or reply_ids[-1] not in stop_ids:
        return None  # cut short: where its rendering would end is not known
    dummy = f"\ue000{secrets.token_hex(8)}"  # a user turn after the reply, found by its text
    later = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": dummy}]
    segments = render(tokenizer, later, tools)
    full = text_of(segments)
    generated = [*stream, *reply_ids]
    seen = tokenizer.decode(generated, skip_special_tokens=False)
    same = _common_chars(full, seen)
    if same == len(seen):
        return None  # rendered as generated: nothing to do
    # The longest run of the stream's tokens whose text the rendering starts with.
    lo, hi = context_len, len(generated) - 1
    if not full.startswith(tokenizer.decode(generated[:lo], skip_special_tokens=False)):
        return None  # an earlier turn renders differently: today's cut at the next turn
    while lo < hi:
        mid = (lo + hi + 1) // 2
        text = tokenizer.decode(generated[:mid], skip_special_tokens=False)
        if len(text) <= same and full.startswith(text):
            lo = mid
        else:
            hi = mid - 1
    keep = min(lo, len(stream))  # the reply is stored whole: a message of its own
    kept = len(tokenizer.decode(generated[:keep], skip_special_tokens=False))
    rest = encode(tokenizer, segments, kept)
    # The reply's end as rendered: its stop token, or the end of a message (harmony renders
    # an earlier reply's <|return|> as <|end|>: app/turns/harmony.py)
    ends = {reply_ids[-1], *harmony.message_ends(tokenizer)}
    end = next((i for i, t in enumerate(rest) if t in ends), None)
    if end is None:
        return None
    ids = rest[: end + 1]
    if dummy in tokenizer.decode(ids, skip_special_tokens=False) or ids == generated[keep:]:
        return None
    return Reencoded(keep, ids)
