"""The app factory: routes, and a lifespan that brings up SQL, the clock and the engine."""

from __future__ import annotations

import contextlib
import logging
import secrets
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.routing import WebSocketRoute

from app import admin, api, pages
from app.chat import Hub, chat_endpoint
from app.metrics import Metrics
from app.settings import Settings

log = logging.getLogger("pensieve")


@dataclass
class Services:
    """Everything a request handler reaches through `app.state.services`."""

    settings: Settings
    store: object  # store.HistoryStore
    clock: object  # ActivityClock: store.RedisClock or engine LocalClock
    engine: object  # engine.AsyncEngine
    admin_token: str
    metrics: Metrics = field(default_factory=Metrics)
    hub: Hub = field(default_factory=Hub)
    running: bool = True

    def engine_running(self) -> bool:
        """Serving, and the engine's step loop is alive (not crashed)."""
        return self.running and bool(getattr(self.engine, "alive", False))


@contextlib.asynccontextmanager
async def lifespan(app: Starlette):
    from engine import AsyncEngine
    from engine.history import LocalClock
    from store import HistoryStore, RedisClock
    from store.migrate import upgrade_async

    settings: Settings = app.state.settings
    config = settings.engine_config()
    await upgrade_async(settings.database_url)
    store = HistoryStore(settings.database_url)
    await store.start()
    clock = RedisClock(settings.redis_url) if settings.redis_url else LocalClock()
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(store.close)
        if settings.redis_url:
            await clock.start()
            stack.push_async_callback(clock.stop)
            if not clock.healthy:
                log.warning(
                    "Redis at %s is down; serving on local activity times", settings.redis_url
                )
        engine = AsyncEngine(config, history=store.token_history(), clock=clock)
        await engine.start()
        stack.push_async_callback(engine.stop)
        admin_token = settings.admin_token
        if not admin_token:
            admin_token = secrets.token_urlsafe(24)
            log.warning(
                "no PENSIEVE_ADMIN_TOKEN set; this run's admin page: http://%s:%s/admin?token=%s",
                settings.host,
                settings.port,
                admin_token,
            )
        sv = Services(settings, store, clock, engine, admin_token)
        sv.metrics.watch(engine.snapshot)
        app.state.services = sv
        log.info("pensieve ready: model %s on %s", settings.model, engine.snapshot().device)
        try:
            yield
        finally:
            sv.running = False
            await sv.hub.drain()


def create_app(settings: Settings | None = None) -> Starlette:
    app = Starlette(
        routes=[
            *api.routes,
            *admin.routes,
            WebSocketRoute("/ws/chat/{conversation_id}", chat_endpoint),
            *pages.routes,
        ],
        lifespan=lifespan,
    )
    app.state.settings = settings or Settings()
    return app
