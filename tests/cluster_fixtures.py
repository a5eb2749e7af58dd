"""A real cluster for tests: N `pensieve serve --cluster` replicas on one PostgreSQL database
and one Redis, behind HAProxy (the config `pensieve cluster` writes). The replicas are started
one by one, not by `pensieve cluster` (bench.lib.services.LocalCluster), so that a test can kill
and restart each itself."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from app.cluster import haproxy
from app.cluster.replica import replica_id
from bench.lib.harness import Local, free_port
from tests import services
from tests.app_fixtures import ADMIN, Server, auth
from tests.services import wait_port

# Small, fast replicas: a random-weight tiny model, small pools, short replies, no quota.
REPLICA_ENV = {
    "PENSIEVE_MODEL": "dummy:tiny",
    "PENSIEVE_GPU_CACHE_CHUNKS": "48",
    "PENSIEVE_CPU_CACHE_CHUNKS": "64",
    "PENSIEVE_MAX_TOKENS_DEFAULT": "8",
    "PENSIEVE_TURNS_PER_MINUTE": "100000",
    "PENSIEVE_CLUSTER": "true",
}


@dataclass
class Front(Local):
    """HAProxy on a free port in front of `servers`."""

    servers: list[Server]
    workdir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    def start(self) -> Front:
        backends = [
            haproxy.Backend(
                haproxy.backend_name(replica_id("127.0.0.1", s.port)), f"127.0.0.1:{s.port}"
            )
            for s in self.servers
        ]
        cfg = self.workdir / "haproxy.cfg"
        cfg.write_text(haproxy.config(backends, f"127.0.0.1:{self.port}", check_s=0.5))
        haproxy.check(str(cfg))
        log = open(self.workdir / "haproxy.log", "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(haproxy.command(str(cfg)), stdout=log, stderr=log)
        log.close()
        wait_port("127.0.0.1", self.port, timeout=10)
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@dataclass
class Cluster:
    """Replicas + HAProxy + PostgreSQL + Redis; `home(cid)` reads the directory."""

    servers: list[Server]
    front: Front
    redis_server: services.RedisServer
    database: str
    redis: redis.Redis = field(init=False)

    def __post_init__(self) -> None:
        self.redis = redis.Redis.from_url(self.redis_server.url, decode_responses=True)

    def home(self, cid: str) -> str | None:
        return self.redis.get(f"pensieve:home:{cid}")

    def server_of(self, replica: str) -> Server:
        return next(s for s in self.servers if replica_id("127.0.0.1", s.port) == replica)

    def listing(self, via: str | None = None) -> dict:
        r = httpx.get((via or self.front.url) + "/api/admin/cluster", headers=auth(ADMIN))
        assert r.status_code == 200, r.text
        return r.json()

    def wait_front_up(self, server: Server, timeout: float = 30.0) -> None:
        """Until HAProxy counts `server` as up (its stats CSV via the admin socket is not
        configured, so ask for a page until the replica serves one through the front)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if server.proc.poll() is None and _healthy(server.url):
                break
            time.sleep(0.2)
        time.sleep(2.0)  # rise 2 checks of 0.5 s, with margin

    def stop(self) -> None:
        self.front.stop()
        for s in self.servers:
            s.stop()
        self.redis.close()
        self.redis_server.kill()
        services.drop_database(self.database)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def start_cluster(tmp: Path, n: int = 3, env: dict[str, str] | None = None) -> Cluster:
    """Start everything; the database is migrated once, before the replicas start."""
    from store.migrate import upgrade_async

    db, url = services.new_database()
    asyncio.run(upgrade_async(url))
    rs = services.RedisServer().start()
    envs = {**REPLICA_ENV, "PENSIEVE_REDIS_URL": rs.url, **(env or {})}
    servers = [Server(url, tmp / f"replica{i}.log", env=envs) for i in range(n)]
    errors: list[BaseException] = []

    def start(s: Server) -> None:
        try:
            s.start()
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for s in servers:
            s.kill()
        rs.kill()
        services.drop_database(db)
        raise errors[0]
    front = Front(servers, tmp).start()
    cluster = Cluster(servers, front, rs, db)
    for s in servers:
        cluster.wait_front_up(s, timeout=10)
        break  # one wait covers the first health checks of all
    return cluster
