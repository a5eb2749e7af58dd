"""What the app's handlers share, built once by the lifespan (app/main.py), and
`services(request)`, how a handler reaches it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from starlette.requests import HTTPConnection

from app.hub import Hub
from app.limits import Quotas
from app.metrics import Metrics
from app.pin_caps import PinCaps
from app.settings import Settings
from app.turns.deps import TurnDeps

if TYPE_CHECKING:  # the engine loads torch
    import httpx

    from app.cluster.directory import Home
    from engine import AsyncEngine
    from engine.persistence import LocalClock
    from store import HistoryStore, RedisClock


class Membership(Protocol):
    """This replica's place in a cluster (`Cluster`, app/cluster/replica.py), as the layers
    below the cluster use it: its id, and the hand-off of a request to a conversation's
    home (app/cluster/handoff.py). The services hold it without naming the cluster, which
    sits above them."""

    forward_key: str
    http: httpx.AsyncClient

    @property
    def id(self) -> str: ...

    async def home_of(self, conversation_id: str, dead: str = "") -> Home | None: ...

    async def home_unreachable(self, conversation_id: str, home: Home) -> Home | None: ...

    async def listing(self) -> dict: ...

    async def stop(self) -> None: ...


@dataclass
class Services:
    settings: Settings
    store: HistoryStore
    clock: RedisClock | LocalClock  # LocalClock without a Redis URL
    engine: AsyncEngine
    admin_token: str
    metrics: Metrics = field(default_factory=Metrics)
    hub: Hub = field(default_factory=Hub)
    quotas: Quotas = field(default_factory=Quotas)  # turns a minute, new users a minute
    pin_caps: PinCaps = field(default_factory=PinCaps)  # owners' pinned bytes, all replicas
    db_probe: asyncio.Task | None = None  # /healthz's database query, while it runs
    cluster: Membership | None = None  # this replica's membership (--cluster)
    running: bool = True
    warm_up_s: float | None = None  # the start's warm-up (app/turns/warm.py); None: none ran

    def engine_running(self) -> bool:
        """Serving, and the engine's step loop is alive (not crashed)."""
        return self.running and bool(getattr(self.engine, "alive", False))

    @property
    def replica(self) -> str | None:
        """Whose engine holds the pins: this replica's id in a cluster, None alone."""
        return self.cluster.id if self.cluster is not None else None

    def turn_deps(self) -> TurnDeps:
        """What a turn uses of the services (app/turns/pipeline.py)."""
        return TurnDeps(
            self.engine,
            self.store,
            self.clock,
            self.hub,
            self.metrics,
            self.settings.reencode_replies,
            self.replica,
            self.pin_caps,
        )


def services(conn: HTTPConnection) -> Services:
    """The app's services, from a request or a WebSocket."""
    return conn.app.state.services
