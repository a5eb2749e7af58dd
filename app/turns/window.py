"""The model's context window of a chat: which stored turns it holds, and a fresh, shorter
window when the next turn would not fit the model's limit.

A window opens with a message marked `starts_context`: its token ids render the system
prompt, the latest earlier turns that fitted, and the message itself. Earlier turns stay in
the stored history; only the model no longer sees them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from app.turns.prompt import chat_messages, encode, render, render_delta, text_of

# A fresh window fills at most this share of the limit, the reply's room included, so that
# the next turns fit again without rebuilding every time.
FRESH_SHARE = 3 / 4


class StoredMessage(Protocol):
    role: str
    content: str
    token_ids: list[int]
    starts_context: bool


class NoRoom(ValueError):
    """Even a window of the system prompt and the new message leaves no room to reply."""


@dataclass
class Plan:
    prompt: list[int]  # the turn's prompt token ids
    context_len: int  # tokens of the window kept before them (0: a fresh window)
    stored_len: int  # the window's stream length before this turn
    fresh: bool  # the prompt opens a new window
    turns_left_out: int  # earlier turns the model no longer sees
    max_tokens: int  # the reply's budget within the limit
    # The template's input for this turn and the window's tokens through its prompt: what
    # the reply is re-encoded against when it ends (app/turns/reencode.py)
    messages: list[dict] = field(default_factory=list)
    stream: list[int] = field(default_factory=list)


def _turns(history: list[StoredMessage], end: int) -> int:
    return sum(1 for m in history[:end] if m.role == "user")


def _pairs(history: list[StoredMessage], start: int, end: int) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in history[start:end]]


def window_start(
    tokenizer, system: str | None, history: list[StoredMessage], tools: list[dict] | None = None
) -> int:
    """Index of the first stored message the current window renders: the earlier turns a
    `starts_context` message carried in, found by the length of its rendered text."""
    opener = max((i for i, m in enumerate(history) if m.starts_context), default=0)
    if opener == 0:
        return 0
    seen = len(tokenizer.decode(history[opener].token_ids, skip_special_tokens=False))

    def length(s: int) -> int:
        last = history[opener]
        msgs = chat_messages(system, _pairs(history, s, opener), last.content, last.role)
        return len(text_of(render(tokenizer, msgs, tools)))

    lo, hi = 0, opener  # the rendered length shrinks as the start moves later
    while lo < hi:
        mid = (lo + hi) // 2
        if length(mid) <= seen:
            hi = mid
        else:
            lo = mid + 1
    return lo


def plan_turn(
    tokenizer,
    system: str | None,
    history: list[StoredMessage],
    content: str,
    limit: int,
    max_tokens: int,
    max_tokens_given: bool,
    before: list[tuple[str, str]] | None = None,
    role: str = "user",
    tools: list[dict] | None = None,
) -> Plan:
    """The next turn's prompt: the current window extended, or a fresh window when the
    reply would not have its room (`max_tokens` if asked for, else up to a quarter of the
    limit). `before`: (role, text) messages the client adds ahead of its new message (an
    API request may add several); the prompt renders them too. `role`: the new message's
    ("tool" for a function's result); `tools`: function definitions offered to the model."""
    before = before or []
    needed = max_tokens if max_tokens_given else min(max_tokens, max(1, limit // 4))
    start = window_start(tokenizer, system, history, tools)
    opener = max((i for i, m in enumerate(history) if m.starts_context), default=0)
    stored = [t for m in history[opener:] for t in m.token_ids]
    msgs = chat_messages(system, _pairs(history, start, len(history)) + before, content, role)
    delta = render_delta(tokenizer, msgs, stored, tools)
    room = limit - delta.context_len - len(delta.token_ids)
    if room >= needed and room >= 1:
        return Plan(
            delta.token_ids,
            delta.context_len,
            len(stored),
            False,
            _turns(history, start),
            min(max_tokens, room),
            msgs,
            stored[: delta.context_len] + delta.token_ids,
        )

    # A fresh window: the system prompt, the latest whole turns that fit, the new message.
    def fresh(s: int) -> list[dict]:
        return chat_messages(system, _pairs(history, s, len(history)) + before, content, role)

    def prompt(s: int) -> list[int]:
        return encode(tokenizer, render(tokenizer, fresh(s), tools))

    starts = [s for s in range(start, len(history)) if history[s].role == "user"]
    starts.append(len(history))
    budget = int(limit * FRESH_SHARE) - needed
    lo, hi = 0, len(starts) - 1  # the prompt shrinks as the start moves later
    while lo < hi:
        mid = (lo + hi) // 2
        if len(prompt(starts[mid])) <= budget:
            hi = mid
        else:
            lo = mid + 1
    ids = prompt(starts[lo])
    if len(ids) + needed > limit:
        raise NoRoom(
            f"the message needs {len(ids)} tokens with the system prompt and {needed} for the "
            f"reply; a chat can hold {limit} tokens here"
        )
    left_out, room = _turns(history, starts[lo]), min(max_tokens, limit - len(ids))
    return Plan(ids, 0, len(stored), True, left_out, room, fresh(starts[lo]), ids)
