"""What a turn uses of the server, and nothing else: the pipeline (and edits) take this, not
the whole `Services` bag, so `turns/` depends on no transport and on no cluster."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine loads torch
    from app.hub import Hub
    from app.metrics import Metrics
    from app.pin_caps import PinCaps
    from engine import AsyncEngine
    from engine.persistence import LocalClock
    from store import HistoryStore, RedisClock


@dataclass(frozen=True)
class TurnDeps:
    engine: AsyncEngine
    store: HistoryStore
    clock: RedisClock | LocalClock  # stamped when a turn stores a message
    hub: Hub  # each chat's history lock
    metrics: Metrics  # a turn's timings
    reencode_replies: bool  # the setting: a reply re-encoded as its template renders it
    replica: str | None  # whose engine holds the pins: this replica's id, None alone
    pin_caps: PinCaps  # owners' pinned bytes, counted with the other replicas
