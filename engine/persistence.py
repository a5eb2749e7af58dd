"""What the engine needs from persistence: raw token history and activity times."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class TokenHistory(Protocol):
    def read(self, conversation_id: str, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of the conversation's stored stream.

        Called from a worker thread, never from the step loop."""
        ...


class ActivityClock(Protocol):
    def last_active(self, conversation_id: str) -> float | None:
        """Unix time of the conversation's last activity; None if unknown. Must not block."""
        ...

    def touch(self, conversation_id: str, when: float | None = None) -> None:
        """Record activity now (or at `when`). Must not block."""
        ...


class MemoryHistory:
    """In-process token history, for benchmarks and the engine used without a server."""

    def __init__(self) -> None:
        self._tokens: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    def append(self, conversation_id: str, token_ids: list[int]) -> None:
        with self._lock:
            self._tokens.setdefault(conversation_id, []).extend(token_ids)

    def truncate(self, conversation_id: str, length: int) -> None:
        with self._lock:
            del self._tokens.setdefault(conversation_id, [])[length:]

    def length(self, conversation_id: str) -> int:
        with self._lock:
            return len(self._tokens.get(conversation_id, ()))

    def forget(self, conversation_id: str) -> None:
        with self._lock:
            self._tokens.pop(conversation_id, None)

    def read(self, conversation_id: str, start: int, end: int) -> list[int]:
        with self._lock:
            tokens = self._tokens.get(conversation_id, [])
            if end > len(tokens):
                raise KeyError(
                    f"history of {conversation_id!r} has {len(tokens)} tokens, asked for [{start}, {end})"
                )
            return tokens[start:end]


class LocalClock:
    """In-process activity clock."""

    def __init__(self, now=time.time) -> None:
        self._now = now
        self._times: dict[str, float] = {}

    def last_active(self, conversation_id: str) -> float | None:
        return self._times.get(conversation_id)

    def touch(self, conversation_id: str, when: float | None = None) -> None:
        self._times[conversation_id] = self._now() if when is None else when

    def forget(self, conversation_id: str) -> None:
        self._times.pop(conversation_id, None)
