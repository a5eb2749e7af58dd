"""Replies in OpenAI's harmony format (gpt-oss): which of a reply's tokens are its answer.

A harmony reply is a run of messages, each a header and a body, the prompt having opened the
first with `<|start|>assistant`:

    <|channel|>analysis<|message|>...reasoning...<|end|>
    <|start|>assistant<|channel|>final<|message|>...the answer...<|return|>

Only the final channel's body is the answer: it streams to the user and is the reply's text
in the chat's history. The other channels (analysis, commentary) stay in the stored stream
but are not shown. gpt-oss's template renders an earlier reply as its final message alone
(`<|start|>assistant<|channel|>final<|message|>...<|end|>`), so the stream is re-encoded that
way when the reply ends (app/turns/reencode.py) and the next turn reuses the whole history.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

FINAL = "final"
_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")
# A message's end: `<|end|>` inside a reply and in history, `<|return|>` at the reply's
# end, `<|call|>` after a tool call.
_ENDS = ("<|end|>", "<|return|>", "<|call|>")


@dataclass(frozen=True)
class Markers:
    channel: int
    message: int
    ends: frozenset[int]


@functools.lru_cache(maxsize=8)
def markers(tokenizer) -> Markers | None:
    """The format's tokens, where the tokenizer has them as special tokens (None: not a
    harmony tokenizer)."""
    added = tokenizer.added_tokens_encoder
    if not all(m in added for m in _MARKERS):
        return None
    ends = frozenset(added[e] for e in _ENDS if e in added)
    return Markers(added["<|channel|>"], added["<|message|>"], ends)


def message_ends(tokenizer) -> frozenset[int]:
    """Tokens that end a message as the template renders it (none without the format)."""
    m = markers(tokenizer)
    return m.ends if m is not None else frozenset()


class Channels:
    """Follows a reply token by token: the channel whose body each token is in."""

    def __init__(self, tokenizer, marks: Markers) -> None:
        self._tok, self._marks = tokenizer, marks
        self._header: list[int] = []  # the open header's tokens (role, channel, recipient)
        self._channel: str | None = None  # the open body's channel (None: in a header)
        self.opened = False  # a body was opened: the reply is in the format

    def route(self, token_id: int) -> str | None:
        """The channel of the body the token is in; None for a header's or a marker."""
        m = self._marks
        if self._channel is None:
            if token_id == m.message:
                self._channel, self._header, self.opened = self._name(), [], True
            else:
                self._header.append(token_id)
            return None
        if token_id in m.ends:
            self._channel = None
            return None
        return self._channel

    def header(self) -> list[int]:
        """The tokens of a header still open (a reply that never opened a body: the model
        wrote plain text, shown as it is)."""
        return list(self._header)

    def _name(self) -> str:
        """The channel a header names (`<|channel|>final`, `<|channel|>commentary to=...`);
        a header without one is the final answer's."""
        ids = self._header
        if self._marks.channel not in ids:
            return FINAL
        after = ids[ids.index(self._marks.channel) + 1 :]
        words = self._tok.decode(after, skip_special_tokens=True).split()
        return words[0] if words else FINAL


def channels(tokenizer) -> Channels | None:
    """A reply's channel follower, for a harmony tokenizer; None otherwise."""
    marks = markers(tokenizer)
    return Channels(tokenizer, marks) if marks is not None else None
