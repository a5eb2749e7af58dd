"""The services the tests run on: the machine's own PostgreSQL and Redis (started when they are
not running), a PostgreSQL database of a test's own, a throwaway Redis on a free port, and
`pensieve cluster` as a subprocess (`pensieve serve` is bench/lib/harness.py's `Server`)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from bench.lib.harness import HOST, Server, ServiceError, free_port, wait_until

# The machine's own services, shared by the tests.
PG_HOST, PG_PORT, PG_USER = HOST, 5432, "postgres"
REDIS_HOST, REDIS_PORT = HOST, 6379


def psql(sql: str, database: str = "postgres") -> str:
    """Run one SQL statement as the postgres user over TCP; returns psql's output."""
    if shutil.which("psql") is None:
        raise ServiceError("psql is not installed")
    cmd = ["psql", "-h", PG_HOST, "-p", str(PG_PORT), "-U", PG_USER, "-d", database]
    cmd += ["-v", "ON_ERROR_STOP=1", "-Atqc", sql]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        raise ServiceError(f"psql {sql!r} failed: {res.stderr.strip()}")
    return res.stdout


def create_database(prefix: str = "pensieve_test") -> str:
    """A new empty PostgreSQL database; returns its name."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    psql(f'CREATE DATABASE "{name}"')
    return name


def drop_database(name: str) -> None:
    psql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def pg_async_url(name: str) -> str:
    return f"postgresql+asyncpg://{PG_USER}@{PG_HOST}:{PG_PORT}/{name}"


def new_database() -> tuple[str, str]:
    """A new database, PostgreSQL started first if need be: its name and asyncpg URL."""
    ensure_postgres()
    name = create_database()
    return name, pg_async_url(name)


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_port(host: str, port: int, timeout: float = 30.0, up: bool = True) -> None:
    """Wait until the port accepts connections (or, with up=False, until it refuses them)."""
    if not wait_until(lambda: port_open(host, port) == up, timeout, every=0.05):
        state = "accept connections" if up else "close"
        raise ServiceError(f"{host}:{port} did not {state} within {timeout:.0f}s")


def _run(cmd: list[str], what: str) -> None:
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise ServiceError(f"cannot start {what}: {cmd[0]} is not installed") from None
    except subprocess.CalledProcessError as e:
        raise ServiceError(
            f"cannot start {what}: {' '.join(cmd)} exited {e.returncode}: {e.stderr.strip()}"
        ) from None


def _start(cmd: list[str], what: str, host: str, port: int) -> None:
    """Run a service's start command; when it fails because another test process (a
    pytest-xdist worker) started the service meanwhile, the port answers: that will do."""
    try:
        _run(cmd, what)
    except ServiceError:
        try:
            wait_port(host, port, timeout=10)
        except ServiceError:
            pass
        else:
            return
        raise
    wait_port(host, port)


def ensure_postgres() -> None:
    if port_open(PG_HOST, PG_PORT):
        return
    conf = Path("/etc/postgresql")
    versions = sorted(conf.iterdir()) if conf.is_dir() else []
    if not versions:
        raise ServiceError(
            "PostgreSQL is not running and no cluster is configured in /etc/postgresql"
        )
    _start(
        ["pg_ctlcluster", "--skip-systemctl-redirect", versions[-1].name, "main", "start"],
        "PostgreSQL",
        PG_HOST,
        PG_PORT,
    )


def ensure_redis() -> None:
    if port_open(REDIS_HOST, REDIS_PORT):
        return
    for d in ("/var/lib/redis", "/var/log/redis"):
        os.makedirs(d, exist_ok=True)
    # Each argument on its own: "--bind" takes both addresses.
    _start(
        [
            "redis-server", "--daemonize", "yes", "--bind", "127.0.0.1", "-::1",
            "--port", str(REDIS_PORT), "--save", "", "--appendonly", "no",
            "--dir", "/var/lib/redis", "--logfile", "/var/log/redis/ci.log",
        ],
        "Redis",
        REDIS_HOST,
        REDIS_PORT,
    )  # fmt: skip


@dataclass
class RedisServer:
    """A throwaway redis-server on a free port, which a test or a run may kill and restart."""

    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def start(self) -> Self:
        if shutil.which("redis-server") is None:
            raise ServiceError("redis-server is not installed")
        self.proc = subprocess.Popen(
            [
                "redis-server", "--bind", HOST, "--port", str(self.port),
                "--save", "", "--appendonly", "no", "--daemonize", "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            wait_port(HOST, self.port, timeout=10)
        except ServiceError:
            self.kill()
            raise
        return self

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections hang instead of being refused."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused server must still die
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None
        wait_port(HOST, self.port, timeout=10, up=False)


@dataclass
class LocalCluster(Server):
    """`pensieve cluster`: `replicas` replicas (on ports after `port` where free) and HAProxy
    on `port`, up once the front lists every replica alive; its launcher restarts a replica
    that dies."""

    replicas: int = 2

    def command(self) -> list[str]:
        return ["cluster", "--replicas", str(self.replicas), "--port", str(self.port)]

    def listing(self) -> dict:
        """GET /api/admin/cluster through the front."""
        import httpx

        headers = {"Authorization": f"Bearer {self.admin_token}"}
        r = httpx.get(self.url + "/api/admin/cluster", headers=headers, timeout=5, trust_env=False)
        r.raise_for_status()
        return r.json()

    def answers(self, healthy: bool = False) -> bool:
        import httpx

        try:
            replicas = self.listing()["replicas"]
        except httpx.HTTPError:
            return False
        return sum(r["alive"] for r in replicas) == self.replicas
