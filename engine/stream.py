"""A conversation's token stream as the engine knows it: written by `Engine` only. (Where its
KV lives is the other record, the chunk table of `engine/cache/chunks.py`, written by the
cache only.)"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class StreamState:
    """A conversation's token stream as the engine knows it. Written by `Engine` only."""

    id: str
    length: int = 0  # tokens in the stream (prompts and outputs so far)
    kv_len: int = 0  # leading positions whose KV was computed (held by the chunks, or dropped)
    tail: list[int] = field(default_factory=list)  # tokens [kv_len, length): KV not computed yet
    busy: bool = False  # a turn of it is queued or running
