"""`pensieve serve` as a subprocess on a free port, logging to a file, for benchmarks and tests
(tests/services.py adds the machine's PostgreSQL and Redis, a throwaway Redis and `pensieve
cluster`). The standard library only at import (tests/conftest.py imports it on GPU machines
without the web stack): httpx is imported where it is used."""

from __future__ import annotations

import os
import secrets
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


class ServiceError(RuntimeError):
    """A process the harness needs could not be started or did not come up."""


def free_port(host: str = HOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_until(ready: Callable[[], bool], timeout: float, every: float = 0.2) -> bool:
    """Poll `ready` until it is true (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True


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
