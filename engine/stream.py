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
    idle_since: float | None = None  # when its last turn ended (None: none has, here)
    # The chain hash of each full chunk of the stream (`chain_hashes`): the disk tier's keys.
    hashes: list[bytes] = field(default_factory=list)
    # Tokens after the last hashed chunk; None when unknown (after a cut or a restart the
    # hashes go on once the history is read again)
    unhashed: list[int] | None = field(default_factory=list)
