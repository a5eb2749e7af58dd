"""`pensieve cluster --replicas N --port P`: N replicas and a front on this machine.

The replicas are ordinary `pensieve serve --cluster` processes on ports P+1..P+N (or free
ports where those are taken), sharing the database, Redis and the admin token; the front
listens on P: HAProxy (app/cluster/haproxy.py, the default), or vLLM's KV-aware router
(`--router vllm-router`, app/cluster/routers.py) reading each replica's KV events. The launcher migrates the database once before the replicas
start (so they do not race on it), restarts a replica that exits on its own, and stops them
all on Ctrl-C or SIGTERM. On real hosts the same layout is run by hand (docs/deploy.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from app.auth import admin_token_from_file
from app.cluster import haproxy
from app.cluster.replica import replica_id
from app.cluster.routers import Worker, vllm_router_command
from app.settings import Settings

log = logging.getLogger("pensieve.cluster")

START_TIMEOUT_S = 600.0  # a replica loads its model before it answers /healthz
RESTART_DELAY_S = 2.0
START_TRIES = 3  # starts of a replica that exits before it is up, before it is left out


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def replica_ports(host: str, port: int, n: int) -> list[int]:
    """P+1..P+N where free, else any free ports."""
    wanted = list(range(port + 1, port + 1 + n))
    if all(0 < p < 65536 and _port_free(host, p) for p in wanted):
        return wanted
    return [_free_port(host) for _ in range(n)]


def _env_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


@dataclass
class Replica:
    host: str
    port: int
    env: dict[str, str]
    log_level: str
    proc: subprocess.Popen | None = None
    restarts: int = 0
    down_since: float | None = None
    tries: int = 0  # starts so far that exited before the replica was up
    events: str | None = None  # its KV events endpoint (a KV-aware front reads them)

    @property
    def id(self) -> str:
        return replica_id(self.host, self.port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "app.cli", "serve", "--host", self.host]
        cmd += ["--port", str(self.port), "--log-level", self.log_level]
        env = (
            self.env
            if self.events is None
            else {**self.env, "PENSIEVE_KV_EVENTS_ENDPOINT": self.events}
        )
        self.proc = subprocess.Popen(cmd, env=env)
        self.down_since = None

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/healthz", timeout=1.0, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False


@dataclass
class Launcher:
    replicas: list[Replica]
    front: str  # host:port the front binds
    workdir: Path
    redis: subprocess.Popen | None = None  # a Redis this launcher started itself
    router: str = "haproxy"
    model: str = ""  # the replicas' model (a KV-aware front names it)
    front_proc: subprocess.Popen | None = None
    stopping: bool = False
    others: list[subprocess.Popen] = field(default_factory=list)

    def start(self) -> None:
        """Start the replicas and wait until each is up. One that exits first is started
        again (on another free port where its own was taken since it was found free: another
        process bound it in between), at most `START_TRIES` times; one that still fails, or
        is not up by the deadline, is left out and the cluster goes on with the others. None
        up: an error."""
        for r in self.replicas:
            r.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting, up = list(self.replicas), []
        while waiting and not self.stopping:
            for r in list(waiting):
                if r.proc.poll() is not None:
                    if not self._start_again(r):
                        waiting.remove(r)
                elif r.healthy():
                    log.info("replica %s is up (pid %d)", r.id, r.proc.pid)
                    waiting.remove(r)
                    up.append(r)
            if waiting and time.monotonic() > deadline:
                log.error("replicas %s did not come up; going on without them",
                          [r.id for r in waiting])  # fmt: skip
                for r in waiting:
                    r.proc.kill()
                    r.proc.wait()
                break
            time.sleep(0.5)
        if self.stopping:
            return
        if not up:
            raise RuntimeError("no replica came up (see the log above)")
        self.replicas = [r for r in self.replicas if r in up]
        self.front_proc = subprocess.Popen(self._front_command())

    def _front_command(self) -> list[str]:
        if self.router == "vllm-router":
            host, port = self.front.rsplit(":", 1)
            workers = [Worker(r.url, r.events or "") for r in self.replicas]
            return vllm_router_command(workers, host, int(port), self.model)
        cfg = self.workdir / "haproxy.cfg"
        backends = [haproxy.Backend(haproxy.backend_name(r.id), f"{r.host}:{r.port}")
                    for r in self.replicas]  # fmt: skip
        cfg.write_text(haproxy.config(backends, self.front))
        haproxy.check(str(cfg))
        return haproxy.command(str(cfg))

    def _start_again(self, r: Replica) -> bool:
        """A replica exited before it was up: start it again, on another port where its own
        is taken now; False once it has had its tries."""
        r.tries += 1
        if r.tries >= START_TRIES:
            log.error("replica %s exited %s on start %d times; the cluster goes on without it",
                      r.id, r.proc.returncode, r.tries)  # fmt: skip
            return False
        if not _port_free(r.host, r.port):
            old, r.port = r.id, _free_port(r.host)
            log.warning("replica %s could not bind its port (taken since); starting it as %s",
                        old, r.id)  # fmt: skip
        else:
            log.warning("replica %s exited %s on start; starting it again",
                        r.id, r.proc.returncode)  # fmt: skip
        r.start()
        return True

    def supervise(self) -> int:
        """Until stopped: restart replicas that exit; the front exiting ends the cluster."""
        while not self.stopping:
            if self.front_proc.poll() is not None:
                log.error("%s exited %s; stopping the cluster", self.router,
                          self.front_proc.returncode)  # fmt: skip
                return 1
            for r in self.replicas:
                if r.proc.poll() is None:
                    continue
                if r.down_since is None:
                    log.warning("replica %s exited %s; restarting it", r.id, r.proc.returncode)
                    r.down_since = time.monotonic()
                elif time.monotonic() - r.down_since >= RESTART_DELAY_S:
                    r.restarts += 1
                    r.start()
            time.sleep(0.2)
        return 0

    def stop(self) -> None:
        self.stopping = True
        stop_all([r.proc for r in self.replicas])
        for p in (self.front_proc, self.redis):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def stop_all(procs: list[subprocess.Popen | None], timeout_s: float = 30.0) -> None:
    """SIGTERM every process still running, then wait for them together; SIGKILL those still
    there after `timeout_s`."""
    live = [p for p in procs if p is not None and p.poll() is None]
    for p in live:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in live:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _start_redis(host: str) -> tuple[subprocess.Popen, str]:
    """A private Redis for a local cluster, when none is given."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ValueError("a cluster needs Redis: give --redis-url, or install redis-server")
    port = _free_port(host)
    proc = subprocess.Popen(
        [binary, "--bind", host, "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return proc, f"redis://{host}:{port}/0"
        time.sleep(0.05)
    proc.kill()
    raise ValueError("the local redis-server did not start")


def run(
    given: dict[str, object],
    replicas: int,
    host: str,
    port: int,
    log_level: str,
    router: str = "haproxy",
) -> int:
    """Start the cluster with the serve settings `given` (name -> value) and `router` in
    front, and supervise it."""
    from store.db import check_database, is_sqlite
    from store.migrate import upgrade_async

    if replicas < 1:
        raise ValueError("--replicas must be at least 1")
    settings = Settings(**given)  # a bad setting fails here, before anything starts
    if is_sqlite(settings.database_url):
        log.warning("replicas sharing a SQLite file serialize their writes; use PostgreSQL")
    asyncio.run(check_database(settings.database_url, settings.database_timeout_s))
    asyncio.run(upgrade_async(settings.database_url))  # once, before the replicas start
    if not settings.admin_token:
        admin_token_from_file(settings.admin_token_file)  # made once, read by every replica
    redis_proc, redis_url = None, given.get("redis_url")
    if not redis_url:
        redis_proc, redis_url = _start_redis(host)
        log.info("started a private Redis at %s", redis_url)
    # The replicas see this environment's PENSIEVE_* settings, with the flags over them.
    env = dict(os.environ)
    env.update({f"PENSIEVE_{k.upper()}": _env_value(v) for k, v in given.items()})
    env.update(PENSIEVE_REDIS_URL=str(redis_url), PENSIEVE_CLUSTER="true")
    env["PENSIEVE_DATABASE_URL"] = settings.database_url
    for own in ("PENSIEVE_REPLICA_ID", "PENSIEVE_REPLICA_URL", "PENSIEVE_HOST", "PENSIEVE_PORT"):
        env.pop(own, None)  # each replica's own
    members = [Replica(host, p, env, log_level) for p in replica_ports(host, port, replicas)]
    if router == "vllm-router":
        vllm_router_command([], host, port, settings.model)  # refuses now when not installed
        for r in members:  # each its own KV events endpoint
            r.events = f"tcp://{host}:{_free_port(host)}"
    with tempfile.TemporaryDirectory(prefix="pensieve-cluster-") as tmp:
        launcher = Launcher(
            members, f"{host}:{port}", Path(tmp), redis_proc, router, settings.model
        )

        def stop(signum, frame) -> None:
            launcher.stopping = True

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        try:
            launcher.start()
            if not launcher.stopping:
                ids = ", ".join(f"{r.id} (pid {r.proc.pid})" for r in launcher.replicas)
                print(f"pensieve cluster on http://{host}:{port}: replicas {ids}", flush=True)
                return launcher.supervise()
            return 0
        finally:
            launcher.stop()
