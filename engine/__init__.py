"""Pensieve's serving engine: paged KV across turns, unified batching, GPU + CPU tiers."""

from engine.errors import ConversationBusy, EngineOverloaded
from engine.persistence import ActivityClock, LocalClock, MemoryHistory, TokenHistory
from engine.seed import Seed
from engine.snapshot import ConversationInfo, EngineCounters, EngineSnapshot, PoolUsage
from engine.types import (
    CacheMode,
    EngineConfig,
    Eviction,
    FinishReason,
    Guide,
    SamplingParams,
    Turn,
    TurnResult,
    TurnStats,
)

__all__ = [
    "ActivityClock",
    "AsyncEngine",
    "CacheMode",
    "ConversationBusy",
    "ConversationInfo",
    "Engine",
    "EngineConfig",
    "EngineCounters",
    "EngineOverloaded",
    "EngineSnapshot",
    "Eviction",
    "FinishReason",
    "LocalClock",
    "MemoryHistory",
    "PoolUsage",
    "Guide",
    "SamplingParams",
    "Seed",
    "TokenHistory",
    "Turn",
    "TurnResult",
    "TurnStats",
]


def __getattr__(name: str):
    # Engine and AsyncEngine import torch: only when used, so that the value types, errors
    # and protocols stay cheap to import (the CLI's `users` command needs no model).
    if name == "Engine":
        from engine.engine import Engine

        return Engine
    if name == "AsyncEngine":
        from engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)
