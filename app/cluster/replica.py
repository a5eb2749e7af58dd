"""This replica's place in a cluster: its heartbeat in the directory, the homes it holds,
where a conversation is served, and the `/api/admin/cluster` listing.

A conversation is served by its home replica (whose engine holds its cache). A replica asked
about a conversation claims it when it has no live home (`Directory.claim`); otherwise the
request is handed to the home (app/cluster/handoff.py). A replica that finds a home unreachable
takes the conversation over at once instead of waiting for the home's TTL to lapse. Taking a
conversation over drops any stale copy this engine holds, so the turn rebuilds its context
from SQL, as after a restart.

With Redis away the replica serves every conversation itself (availability over cache
locality) and says so in its health.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass, field

import httpx
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.auth import is_admin
from app.cluster.directory import Directory, Home
from app.services import Services, services

log = logging.getLogger("pensieve.cluster")

HEARTBEAT_S = 1.0
ALIVE_TTL_S = 5.0  # a replica silent this long is dead: its conversations may move
HOME_TTL_S = 60.0
PRUNE_AFTER_S = 30.0  # a home whose chat holds nothing in the engine for this long is given up
HELD_LISTED = 300  # conversations a replica lists in its report (the count is always whole)
REDIS_ERRORS = (RedisError, OSError, TimeoutError)


def forward_key(admin_token: str) -> str:
    """The mark of a request one replica hands to another: replicas share the admin token,
    clients cannot forge the mark without it."""
    return hmac.new(admin_token.encode(), b"pensieve-forward", hashlib.sha256).hexdigest()


def replica_id(host: str, port: int) -> str:
    return f"{_public_host(host)}:{port}"


def replica_url(host: str, port: int) -> str:
    return f"http://{_public_host(host)}:{port}"


def _public_host(host: str) -> str:
    """An address other hosts can reach for a wildcard bind."""
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host


@dataclass
class Cluster:
    """Cluster membership of one replica."""

    directory: Directory
    url: str
    services: Services
    forward_key: str
    started: float = field(default_factory=time.time)
    homes: dict[str, float] = field(default_factory=dict)  # conversation -> claimed at
    unreachable: dict[str, str] = field(default_factory=dict)  # replica -> its `started`
    redis_ok: bool = False
    http: httpx.AsyncClient = field(
        default_factory=lambda: httpx.AsyncClient(
            timeout=httpx.Timeout(connect=2.0, read=None, write=30.0, pool=5.0),
            trust_env=False,  # replicas talk directly, never through a proxy
        )
    )
    _task: asyncio.Task | None = None

    @property
    def id(self) -> str:
        return self.directory.me

    # --- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        await self.beat()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="cluster")
        log.info("replica %s (%s) joined the cluster", self.id, self.url)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(*REDIS_ERRORS):
            await self.directory.release(list(self.homes))
            await self.directory.leave()
        await self.http.aclose()
        await self.directory.close()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await self.beat()
            except Exception:  # a bug must not stop the heartbeat
                log.exception("cluster heartbeat failed")

    async def beat(self) -> None:
        """Say this replica lives, keep its homes, give up those it no longer needs."""
        snap = self.services.engine.snapshot()
        held = {c.id for c in snap.conversations}
        try:
            await self.directory.heartbeat(self.started, self.report(snap))
            lost = await self.directory.refresh(list(self.homes))
            now = time.time()
            idle = [
                cid
                for cid, at in self.homes.items()
                if cid not in held and now - at > PRUNE_AFTER_S and not self.services.hub.busy(cid)
            ]
            await self.directory.release(idle)
        except REDIS_ERRORS as e:
            if self.redis_ok:
                log.warning("cluster directory unreachable (%r); serving every chat here", e)
            self.redis_ok = False
            return
        if not self.redis_ok:
            log.info("cluster directory reachable")
        self.redis_ok = True
        for cid in idle:
            self.homes.pop(cid, None)
        for cid in lost:  # another replica took it over while this one seemed dead
            log.warning("conversation %s moved to another replica", cid)
            self.homes.pop(cid, None)
            await self._drop_copy(cid)

    def report(self, snap) -> dict:
        """What the admin listing shows of this replica."""
        convs = sorted(snap.conversations, key=lambda c: (c.idle_s is None, c.idle_s or 0))
        return {
            "url": self.url,
            "pid": os.getpid(),
            "health": "ok" if self.services.engine_running() else "down",
            "device": snap.device,
            "chunk_size": snap.chunk_size,
            "pools": {"gpu": asdict(snap.gpu), "cpu": asdict(snap.cpu)},
            "conversations": len(snap.conversations),
            "homes": len(self.homes),
            "live_sockets": self.services.hub.sockets(),
            "held": [
                {
                    "id": c.id,
                    "tokens": c.tokens,
                    "gpu": c.chunks.count("gpu"),
                    "cpu": c.chunks.count("cpu"),
                    "dropped": c.chunks.count("dropped"),
                    "running": c.running,
                }
                for c in convs[:HELD_LISTED]
            ],
        }

    # --- where a conversation is served -------------------------------------------------
    async def home_of(self, conversation_id: str, dead: str = "") -> Home | None:
        """The live home replica to hand `conversation_id` to, or None: serve it here (this
        replica is its home now, or the directory cannot be reached)."""
        try:
            home = await self.directory.claim(conversation_id, dead)
            if home.replica != self.id and self.unreachable.get(home.replica) == home.started:
                # Found unreachable before and not restarted since: take it over now.
                home = await self.directory.claim(conversation_id, home.replica)
        except REDIS_ERRORS as e:
            log.warning("cluster directory unreachable (%r); serving %s here", e, conversation_id)
            self.redis_ok = False
            return None
        if home.replica != self.id:
            return home
        if home.previous and home.previous != self.id:
            log.info("took over %s from %s", conversation_id, home.previous)
        if home.previous != self.id:
            await self._drop_copy(conversation_id)
        self.homes[conversation_id] = time.time()
        return None

    async def home_unreachable(self, conversation_id: str, home: Home) -> Home | None:
        """`home` did not answer: take the conversation over (or find who already did)."""
        log.warning("replica %s (%s) is unreachable", home.replica, home.url)
        self.unreachable[home.replica] = home.started
        return await self.home_of(conversation_id, dead=home.replica)

    async def _drop_copy(self, cid: str) -> None:
        """Forget this engine's copy of a chat another replica served meanwhile: it may be
        stale, and the next turn here rebuilds the context from SQL."""
        if self.services.hub.busy(cid):
            return
        if all(c.id != cid for c in self.services.engine.snapshot().conversations):
            return  # nothing held: spare the engine loop a round trip
        try:
            await self.services.engine.free(cid)
        except Exception:  # the turn's context_len resyncs the engine anyway
            log.exception("could not free %s", cid)

    # --- admin listing ------------------------------------------------------------------
    async def listing(self) -> dict:
        snap = self.services.engine.snapshot()
        me = {**self.report(snap), "id": self.id, "alive": True, "self": True}
        try:
            replicas = await self.directory.replicas()
        except REDIS_ERRORS as e:
            return {"replica": self.id, "directory": f"unreachable: {e!r}", "replicas": [me]}
        now = time.time()
        out = []
        for r in replicas:
            if r["id"] == self.id:
                out.append({**r, **me})
                continue
            seen = r.get("last_seen")
            r["seen_s_ago"] = round(now - seen, 1) if isinstance(seen, float) else None
            if not r["alive"]:
                r["health"] = "down"
            out.append(r)
        return {"replica": self.id, "directory": "ok", "replicas": out}


async def cluster_listing(request: Request) -> Response:
    """GET /api/admin/cluster: every replica with id, url, pid, health, pools, conversations.
    A server outside a cluster lists itself alone."""
    sv = services(request)
    if not is_admin(request, sv.admin_token):
        return JSONResponse(
            {"error": "unauthorized", "message": "the admin token is required"}, status_code=401
        )
    cluster: Cluster | None = sv.cluster
    if cluster is None:
        snap = sv.engine.snapshot()
        me = {
            "id": "local",
            "alive": True,
            "self": True,
            "pid": os.getpid(),
            "health": "ok" if sv.engine_running() else "down",
            "pools": {"gpu": asdict(snap.gpu), "cpu": asdict(snap.cpu)},
            "conversations": len(snap.conversations),
        }
        body = {"replica": "local", "directory": "disabled", "replicas": [me]}
    else:
        body = await cluster.listing()
    body["time"] = time.time()
    return JSONResponse(body, headers={"Cache-Control": "no-store"})


routes = [Route("/api/admin/cluster", cluster_listing, methods=["GET"])]
