"""Local processes for tests and benchmarks: free ports; the machine's own PostgreSQL and
Redis, or a throwaway Redis on a free port; `pensieve serve` and `pensieve cluster` as
subprocesses logging to a file. The standard library only at import (tests/conftest.py
imports it on GPU machines without the web stack): httpx is imported where it is used."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Self

from bench.lib.common import ROOT

HOST = "127.0.0.1"
# The machine's own services, shared by the tests.
PG_HOST, PG_PORT, PG_USER = HOST, 5432, "postgres"
REDIS_HOST, REDIS_PORT = HOST, 6379


class ServiceError(RuntimeError):
    """A process the harness needs could not be started or did not come up."""


def free_port(host: str = HOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_until(ready: Callable[[], bool], timeout: float, every: float = 0.2) -> bool:
    """Poll `ready` until it is true (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True


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


class Local:
    """Something listening on a local port (`self.port`): its HTTP and chat-socket addresses."""

    port: int

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://{HOST}:{self.port}/ws/chat/"


def _without_settings() -> dict[str, str]:
    """This process's environment less its PENSIEVE_* settings."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PENSIEVE_")}


@dataclass
class Server(Local):
    """`pensieve serve` on a free port, its output in `log_path`; it can be stopped, killed
    and started again on the same database. Its settings are `env` (PENSIEVE_* variables,
    over the class's `defaults`) and `args` (flags), never this process's own PENSIEVE_*."""

    database_url: str
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    log_level: str = "warning"  # "info" writes the access log
    admin_token: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    cwd: Path = ROOT  # where `python -m app.cli` runs: a checkout's root finds its app
    proc: subprocess.Popen | None = None
    defaults: ClassVar[dict[str, str]] = {}

    def command(self) -> list[str]:
        return ["serve", "--port", str(self.port)]

    def environ(self) -> dict[str, str]:
        env = _without_settings()
        env.update(PENSIEVE_DATABASE_URL=self.database_url, PENSIEVE_ADMIN_TOKEN=self.admin_token)
        return {**env, **self.defaults, **self.env}

    def answers(self, healthy: bool = False) -> bool:
        """/healthz answers: 200, or 503 while a dependency is down; with `healthy`, 200."""
        import httpx

        try:
            status = httpx.get(self.url + "/healthz", timeout=2, trust_env=False).status_code
        except httpx.HTTPError:
            return False
        return status == 200 or (status == 503 and not healthy)

    def start(self, timeout: float = 180.0, healthy: bool = False) -> Self:
        """Start it and wait until it `answers`; ServiceError, with the log's tail, when it
        exits or does not answer within `timeout` (then it is killed)."""
        name = f"pensieve {self.command()[0]}"
        cmd = [sys.executable, "-m", "app.cli", *self.command(), "--log-level", self.log_level]
        with open(self.log_path, "ab") as log:  # the child keeps its own handle
            self.proc = subprocess.Popen(
                [*cmd, *self.args], cwd=self.cwd, env=self.environ(), stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        proc = self.proc

        def up() -> bool:
            if proc.poll() is not None:
                raise ServiceError(f"{name} exited {proc.returncode}:\n{self.log_tail()}")
            return self.answers(healthy)

        if not wait_until(up, timeout):
            self.kill()
            raise ServiceError(f"{name} did not come up in {timeout:.0f}s:\n{self.log_tail()}")
        return self

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, and SIGKILL when it has not exited after `timeout`: its exit code, or
        None when it had to be killed (or never ran)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                return None
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def user(self, name: str = "tester") -> str:
        """A new owner through `pensieve users create`; its token (the last output line)."""
        res = subprocess.run(
            [sys.executable, "-m", "app.cli", "users", "create", name],
            cwd=self.cwd, env=self.environ(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if res.returncode != 0:
            raise ServiceError(f"users create exited {res.returncode}: {res.stderr[-2000:]}")
        return res.stdout.strip().splitlines()[-1]


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
