"""What the app's handlers share, built once by the lifespan (app/main.py), and
`services(request)`, how a handler reaches it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.requests import HTTPConnection

from app.hub import Hub
from app.limits import RateLimit
from app.metrics import Metrics
from app.settings import Settings

if TYPE_CHECKING:  # the engine loads torch, and the cluster refers back to Services
    from app.cluster.replica import Cluster
    from engine import AsyncEngine
    from engine.persistence import LocalClock
    from store import HistoryStore, RedisClock


@dataclass
class Services:
    settings: Settings
    store: HistoryStore
    clock: RedisClock | LocalClock  # LocalClock without a Redis URL
    engine: AsyncEngine
    admin_token: str
    metrics: Metrics = field(default_factory=Metrics)
    hub: Hub = field(default_factory=Hub)
    new_users: RateLimit = field(default_factory=lambda: RateLimit(10))
    db_probe: asyncio.Task | None = None  # /healthz's database query, while it runs
    cluster: Cluster | None = None  # this replica's membership (--cluster)
    running: bool = True

    def engine_running(self) -> bool:
        """Serving, and the engine's step loop is alive (not crashed)."""
        return self.running and bool(getattr(self.engine, "alive", False))


def services(conn: HTTPConnection) -> Services:
    """The app's services, from a request or a WebSocket."""
    return conn.app.state.services
