"""The app factory: routes, and a lifespan that brings up SQL, the clock and the engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from sqlalchemy.exc import SQLAlchemyError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import WebSocketRoute

from app import admin, kv_events, openai, pages, rest
from app.auth import admin_token_from_file
from app.cluster import replica
from app.cluster.directory import Directory
from app.cluster.handoff import HandOff
from app.http import problem
from app.limits import Quotas
from app.logs import redact_access_logs
from app.middleware import SameOriginWrites, SecurityHeaders
from app.pin_caps import PinCaps
from app.services import Services
from app.settings import Settings
from app.socket.chat import chat_endpoint
from app.turns import retention, warm

log = logging.getLogger("pensieve")


@contextlib.asynccontextmanager
async def lifespan(app: Starlette):
    from engine import AsyncEngine
    from engine.persistence import LocalClock
    from store import HistoryStore, RedisClock
    from store.migrate import upgrade_async

    settings: Settings = app.state.settings
    config = settings.engine_config()
    redact_access_logs()
    await upgrade_async(settings.database_url)
    store = HistoryStore(settings.database_url, timeout_s=settings.database_timeout_s)
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
        template = Path(settings.chat_template).read_text() if settings.chat_template else None
        engine = AsyncEngine(config, history=store.token_history(), clock=clock)
        await engine.start()
        stack.push_async_callback(engine.stop)
        if settings.kv_events_endpoint:
            publisher = kv_events.Publisher(
                engine.kv_events,
                config.chunk_size,
                settings.kv_events_endpoint,
                settings.kv_events_replay_endpoint,
                settings.kv_events_topic,
            )
            publisher.start()
            stack.callback(publisher.stop)
        if template is not None:  # rendered by the app only: the engine sees token ids
            engine.tokenizer.chat_template = template
        admin_token = settings.admin_token
        if not admin_token:
            # Never logged: the operator reads it from a file only its user can read.
            admin_token = admin_token_from_file(settings.admin_token_file)
            log.warning(
                "no PENSIEVE_ADMIN_TOKEN set; the admin token is in %s", settings.admin_token_file
            )
        sv = Services(
            settings,
            store,
            clock,
            engine,
            admin_token,
            quotas=Quotas(settings.redis_url),
            pin_caps=PinCaps(settings.redis_url),
        )
        stack.push_async_callback(sv.pin_caps.close)
        sv.metrics.watch(engine.snapshot)
        if settings.cluster:
            sv.cluster = await _join_cluster(settings, sv)
            stack.push_async_callback(sv.cluster.stop)  # before the engine stops
        # the pins that were in force when it last stopped
        await retention.restore(engine, store, sv.replica)
        # before ready: the first message pays no one-time costs
        sv.warm_up_s = await warm.warm_up(engine)
        if settings.kv_events_endpoint and engine.disk_tier:  # what a restart found on disk
            restoring = asyncio.create_task(kv_events.announce_disk(engine, store))
            stack.callback(restoring.cancel)
        app.state.services = sv
        log.info("pensieve ready: model %s on %s", settings.model, engine.snapshot().device)
        try:
            yield
        finally:
            sv.running = False
            await sv.hub.drain()


async def _join_cluster(settings: Settings, sv: Services) -> replica.Cluster:
    me = settings.replica_id or replica.replica_id(settings.host, settings.port)
    member = replica.Cluster(
        Directory(
            settings.redis_url, me, alive_ttl_s=replica.ALIVE_TTL_S, home_ttl_s=replica.HOME_TTL_S
        ),
        settings.replica_url or replica.replica_url(settings.host, settings.port),
        sv,
        replica.forward_key(sv.admin_token),
    )
    await member.start()
    return member


async def database_unavailable(request: Request, exc: Exception) -> Response:
    """A database that fails or does not answer in time: a clear 503 instead of a 500."""
    log.warning("%s %s: database unavailable: %s", request.method, request.url.path, exc)
    return problem(
        503,
        "database_unavailable",
        "the database is not answering; try again shortly",
        headers={"Retry-After": "5"},
    )


def create_app(settings: Settings | None = None) -> Starlette:
    settings = settings or Settings()
    app = Starlette(
        routes=[
            *rest.routes,
            *openai.routes,
            *admin.routes,
            *replica.routes,
            WebSocketRoute("/ws/chat/{conversation_id}", chat_endpoint),
            *pages.routes,
        ],
        lifespan=lifespan,
        exception_handlers={
            SQLAlchemyError: database_unavailable,
            TimeoutError: database_unavailable,
            ConnectionError: database_unavailable,
        },
        middleware=[
            Middleware(HandOff),  # first: a request for another replica's chat goes there
            Middleware(SecurityHeaders),
            Middleware(SameOriginWrites, allowed=settings.allowed_origins),
        ],
    )
    app.state.settings = settings
    return app
