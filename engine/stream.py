"""A conversation's token stream as the engine knows it: written by `Engine` only (where its
KV lives is the other record, the chunk table of `engine/cache/chunks.py`, written by the
cache only); and `Claims`, the one record of which conversations have a turn in flight."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from engine.cache.manager import KVCacheManager, chain_hashes
from engine.errors import ConversationBusy


class Claims:
    """One turn per conversation at a time: the conversations with a turn queued or running,
    for every front of one engine. Its own short lock, not the engine's step lock, so the async
    front claims on its event loop while a step runs."""

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._lock = threading.Lock()

    def claim(self, conversation_id: str) -> None:
        """Take the conversation's turn slot; ConversationBusy if a turn holds it."""
        with self._lock:
            if conversation_id in self._ids:
                raise ConversationBusy(
                    f"conversation {conversation_id!r} already has a turn in flight"
                )
            self._ids.add(conversation_id)

    def release(self, conversation_id: str) -> None:
        with self._lock:
            self._ids.discard(conversation_id)

    def __contains__(self, conversation_id: str) -> bool:
        with self._lock:
            return conversation_id in self._ids


@dataclass(eq=False)
class StreamState:
    """A conversation's token stream as the engine knows it. Written by `Engine` only."""

    id: str
    length: int = 0  # tokens in the stream (prompts and outputs so far)
    kv_len: int = 0  # leading positions whose KV was computed (held by the chunks, or dropped)
    tail: list[int] = field(default_factory=list)  # tokens [kv_len, length): KV not computed yet
    idle_since: float | None = None  # when its last turn ended (None: none has, here)
    # When its current job began: the arrival of its last turn that did not carry a tool's
    # result (turns linked by tool calls are one job, as an agent's loop is)
    job_since: float | None = None
    # The chain hash of each full chunk of the stream (`chain_hashes`): the disk tier's keys.
    hashes: list[bytes] = field(default_factory=list)
    # Tokens after the last hashed chunk; None when unknown (after a cut or a restart the
    # hashes go on once the history is read again)
    unhashed: list[int] | None = field(default_factory=list)


def resync(state: StreamState, length: int, cache: KVCacheManager) -> None:
    """The caller's durable history says the stream has `length` tokens before this turn."""
    table = cache.table(state.id)
    cs = cache.chunk_size
    if length < state.length:  # cut back: its hashes as far as they still hold
        keep = length // cs
        if keep < len(state.hashes):  # the tokens of a cut chunk are not kept
            del state.hashes[keep:]
            state.unhashed = [] if length % cs == 0 else None
        elif state.unhashed is not None:
            state.unhashed = state.unhashed[: length - keep * cs]
    elif length > state.length:
        state.hashes, state.unhashed = [], None
    if length < state.length and length >= state.kv_len:
        del state.tail[length - state.kv_len :]
    elif length < state.length:
        cache.truncate(table, length)
        state.kv_len = min(state.kv_len, length)
        state.tail = []
    else:  # longer than we know (e.g. a restart): all of it comes back from history
        cache.reset(table, length)
        state.kv_len = length
        state.tail = []
    state.length = length


def extend_hashes(
    state: StreamState, base: int, turn: list[int], prefix: list[int] | None, cs: int
) -> None:
    """Extend the stream's chunk hashes over a turn's tokens (`turn`: positions from `base`
    on), from `prefix` (the history read for it) when the tokens before it are not known."""
    done = len(state.hashes) * cs
    known = done + len(state.unhashed or [])
    if state.unhashed is not None and base <= known <= base + len(turn):
        tokens = state.unhashed + turn[known - base :]
    elif prefix is not None and len(prefix) >= base:
        state.hashes, done = [], 0
        tokens = list(prefix[:base]) + turn
    else:  # the tokens before this turn are unknown here: the keys stop
        return
    full = len(tokens) // cs * cs
    prev = state.hashes[-1] if state.hashes else b""
    state.hashes += chain_hashes(tokens[:full], cs, prev)
    state.unhashed = tokens[full:]
