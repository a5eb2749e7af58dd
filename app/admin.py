"""Operator surface: cache snapshot (admin token), health and Prometheus metrics."""

from __future__ import annotations

import time

from sqlalchemy import select, text
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.api import problem
from app.auth import is_admin
from store.models import Conversation


async def cache(request: Request) -> Response:
    sv = request.app.state.services
    if not is_admin(request, sv.admin_token):
        return problem(401, "unauthorized", "the admin token is required (Authorization: Bearer)")
    snap = sv.engine.snapshot().to_dict()
    convs = snap["conversations"]
    titles = await _titles(sv.store, [c["id"] for c in convs])
    for c in convs:
        c["title"] = titles.get(c["id"])
    snap["conversations"] = convs
    snap["time"] = time.time()
    return JSONResponse(snap, headers={"Cache-Control": "no-store"})


async def _titles(store, ids: list[str]) -> dict[str, str]:
    if not ids:
        return {}
    async with store.sessions() as s:
        rows = await s.execute(
            select(Conversation.id, Conversation.title).where(Conversation.id.in_(ids))
        )
        return {cid: title for cid, title in rows}


async def healthz(request: Request) -> Response:
    sv = request.app.state.services
    checks: dict[str, dict] = {}
    try:
        async with sv.store.engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
        checks["database"] = {"status": "ok"}
    except Exception as e:
        checks["database"] = {"status": "down", "error": f"{type(e).__name__}: {e}"}
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
    return JSONResponse({"status": status, "checks": checks}, status_code=code)


async def metrics(request: Request) -> Response:
    body = request.app.state.services.metrics.render()
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


routes = [
    Route("/api/admin/cache", cache, methods=["GET"]),
    Route("/healthz", healthz, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]
