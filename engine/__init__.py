"""Pensieve's serving engine: paged KV across turns, unified batching, GPU + CPU tiers."""

from engine.engine import ConversationBusy, Engine
from engine.history import ActivityClock, LocalClock, MemoryHistory, TokenHistory
from engine.types import EngineConfig, SamplingParams, Turn, TurnResult, TurnStats

__all__ = [
    "ActivityClock",
    "AsyncEngine",
    "ConversationBusy",
    "Engine",
    "EngineConfig",
    "LocalClock",
    "MemoryHistory",
    "SamplingParams",
    "TokenHistory",
    "Turn",
    "TurnResult",
    "TurnStats",
]


def __getattr__(name: str):
    if name == "AsyncEngine":  # imports asyncio machinery only when used
        from engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)
