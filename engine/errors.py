"""Errors the engine's callers handle: refusals of a turn that say what to do next."""

from __future__ import annotations


class ConversationBusy(RuntimeError):
    """A turn of this conversation is already queued or running."""


class EngineOverloaded(RuntimeError):
    """The engine's queue is full; try again in about `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
