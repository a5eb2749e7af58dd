"""Operator surface: cache snapshot (admin token), health and Prometheus metrics."""

from __future__ import annotations

import asyncio
import time

from sqlalchemy import select, text
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.auth import is_admin
from app.http import problem
from app.services import services
from store.models import Conversation

HEALTH_TIMEOUT_S = 2.0


async def cache(request: Request) -> Response:
    sv = services(request)
    if not is_admin(request, sv.admin_token):
        return problem(401, "unauthorized", "the admin token is required (Authorization: Bearer)")
    snap = sv.engine.snapshot().to_dict()
    convs = snap["conversations"]
    titles = await _titles(sv.store, [c["id"] for c in convs])
    for c in convs:
        c["title"] = titles.get(c["id"])
    snap["conversations"] = convs
    snap["time"] = time.time()
    snap["turns"] = {"count": sv.metrics.turns, "ttft_sum_s": round(sv.metrics.ttft_sum_s, 6)}
    return JSONResponse(snap, headers={"Cache-Control": "no-store"})


async def _titles(store, ids: list[str]) -> dict[str, str]:
    if not ids:
        return {}
    async with store.sessions() as s:
        rows = await s.execute(
            select(Conversation.id, Conversation.title).where(Conversation.id.in_(ids))
        )
        return {cid: title for cid, title in rows}


async def _select_one(engine) -> None:
    async with engine.connect() as conn:
        await conn.execute(text("SELECT 1"))


async def healthz(request: Request) -> Response:
    sv = services(request)
    checks: dict[str, dict] = {}
    # A probe must answer even when the database does not. The query runs as a task of its
    # own: one that overruns is left to end by the driver's timeouts (its cleanup waits on
    # the dead link too), and later probes wait on it rather than pile up new ones.
    if sv.db_probe is None or sv.db_probe.done():
        sv.db_probe = asyncio.create_task(_select_one(sv.store.engine))
    done, _ = await asyncio.wait({sv.db_probe}, timeout=HEALTH_TIMEOUT_S)
    if not done:
        checks["database"] = {"status": "down", "error": f"no answer in {HEALTH_TIMEOUT_S:g} s"}
    elif (e := sv.db_probe.exception()) is not None:
        checks["database"] = {"status": "down", "error": f"{type(e).__name__}: {e}"}
    else:
        checks["database"] = {"status": "ok"}
    if sv.settings.redis_url:
        healthy = getattr(sv.clock, "healthy", False)
        checks["redis"] = (
            {"status": "ok"}
            if healthy
            else {
                "status": "down",
                "error": getattr(sv.clock, "last_error", None),
                "fallback": "activity times are kept in this process until Redis is back",
            }
        )
    else:
        checks["redis"] = {"status": "disabled"}
    checks["engine"] = {"status": "ok" if sv.engine_running() else "down"}
    down = [k for k, v in checks.items() if v["status"] == "down"]
    if "database" in down or "engine" in down:
        status, code = "down", 503
    elif down:
        status, code = "degraded", 200  # still serving, on the local clock
    else:
        status, code = "ok", 200
    # the warm-up ran before ready (app/turns/warm.py): its seconds, null where none is needed
    body = {"status": status, "checks": checks, "warm_up_s": _rounded(sv.warm_up_s)}
    return JSONResponse(body, status_code=code)


async def health(request: Request) -> Response:
    """vLLM's `/health`, which routers in front of engines poll (vllm-router, Dynamo's):
    200 with no body while the engine serves, else 503. `/healthz` tells the details."""
    return Response(status_code=200 if services(request).engine_running() else 503)


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 2)


async def metrics(request: Request) -> Response:
    body = services(request).metrics.render()
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


routes = [
    Route("/api/admin/cache", cache, methods=["GET"]),
    Route("/healthz", healthz, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]
