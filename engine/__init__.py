"""Pensieve's serving engine: paged KV across turns, unified batching, GPU + CPU tiers."""

from engine.engine import ConversationBusy, Engine, EngineOverloaded
from engine.history import ActivityClock, LocalClock, MemoryHistory, TokenHistory
from engine.snapshot import ConversationInfo, EngineCounters, EngineSnapshot, PoolUsage
from engine.types import EngineConfig, SamplingParams, Turn, TurnResult, TurnStats

__all__ = [
    "ActivityClock",
    "AsyncEngine",
    "ConversationBusy",
    "ConversationInfo",
    "Engine",
    "EngineConfig",
    "EngineCounters",
    "EngineOverloaded",
    "EngineSnapshot",
    "LocalClock",
    "MemoryHistory",
    "PoolUsage",
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
