"""What a caller asks of one turn, whichever front it came through (the chat socket's
frames, the OpenAI API's bodies)."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.turns.retention import RetentionField, RetentionName
from engine.types import Retention, SamplingParams


@dataclass
class TurnRequest:
    """What a client asks of one turn (the app's; the engine's `Request` is another thing):
    its message and sampling; `max_tokens_given` when the client chose the reply's length."""

    content: str
    sampling: SamplingParams
    max_tokens_given: bool
    # (role, text) messages sent ahead of `content` in one request (the OpenAI API).
    before: list[tuple[str, str]] = field(default_factory=list)
    role: str = "user"  # or "tool": `content` is a function's result (the OpenAI API)
    tools: list[dict] | None = None  # function definitions offered to the model
    retention: Retention | None = None  # what the cache keeps of the chat after the turn
    # the retention fields as sent (a frame's), made a `Retention` where the owner is known
    asked: tuple[RetentionName | None, RetentionField | None] = (None, None)


def check_text(text: str) -> str | None:
    """Why SQL and the tokenizer cannot take this text, or None."""
    if "\x00" in text:
        return "must not contain NUL characters"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "must not contain unpaired UTF-16 surrogates"
    return None
