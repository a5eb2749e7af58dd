"""A real `pensieve serve` in a subprocess, and a small WebSocket chat client for tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import websockets

from tests import services
from tests.services import free_port

ROOT = Path(__file__).resolve().parent.parent
ADMIN = "test-admin-token"
# Small pools so that a few short chats already swap and drop chunks.
TINY = {"PENSIEVE_GPU_CACHE_CHUNKS": "24", "PENSIEVE_CPU_CACHE_CHUNKS": "32"}


class Local:
    """Something listening on a local port (`self.port`): its HTTP and chat-socket addresses."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws/chat/"


@dataclass
class Server(Local):
    """`pensieve serve` on a free port; SIGKILL-able, restartable on the same database."""

    database_url: str
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    log_level: str = "warning"  # "info" writes the access log
    proc: subprocess.Popen | None = None

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PENSIEVE_")}
        env.update(
            PENSIEVE_DATABASE_URL=self.database_url,
            PENSIEVE_ADMIN_TOKEN=ADMIN,
            PENSIEVE_DEVICE="cpu",
            PENSIEVE_MAX_TOKENS_DEFAULT="24",
        )
        env.update(self.env)
        return env

    def start(self, timeout: float = 180.0) -> Server:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
        cmd = [
            sys.executable,
            "-m",
            "app.cli",
            "serve",
            "--port",
            str(self.port),
            "--log-level",
            self.log_level,
        ]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self._env(), stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code in (200, 503):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"server did not come up in {timeout:.0f}s:\n{self.log_tail()}")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    # --- REST helpers ------------------------------------------------------------------
    def user(self, name: str = "tester") -> str:
        """A new owner through `pensieve users create`; its token is the last output line."""
        out = subprocess.run(
            [sys.executable, "-m", "app.cli", "users", "create", name],
            cwd=ROOT,
            env=self._env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return out.stdout.strip().splitlines()[-1]

    def new_chat(self, token: str, **body) -> str:
        r = httpx.post(self.url + "/api/conversations", json=body, headers=auth(token))
        assert r.status_code == 201, r.text
        return r.json()["id"]

    def chat(self, token: str, cid: str) -> dict:
        r = httpx.get(f"{self.url}/api/conversations/{cid}", headers=auth(token))
        assert r.status_code == 200, r.text
        return r.json()

    def cache(self) -> dict:
        r = httpx.get(self.url + "/api/admin/cache", headers=auth(ADMIN))
        assert r.status_code == 200, r.text
        return r.json()


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def connect(server: Server, cid: str, token: str | None, **kw):
    headers = {**(auth(token) if token else {}), **kw.pop("additional_headers", {})}
    return websockets.connect(server.ws + cid, additional_headers=headers, **kw)


async def recv(ws, timeout: float = 60.0) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


@dataclass
class Reply:
    text: str
    pieces: list[str]
    done: dict
    errors: list[dict]


async def until_done(ws, timeout: float = 120.0) -> Reply:
    """Frames up to `done`: token texts, the done frame, any error frames on the way."""
    pieces, errors = [], []
    while True:
        frame = await recv(ws, timeout)
        if frame["type"] == "token":
            pieces.append(frame["text"])
        elif frame["type"] == "error":
            errors.append(frame)
        elif frame["type"] == "done":
            return Reply("".join(pieces), pieces, frame, errors)
        else:
            raise AssertionError(f"unexpected frame {frame}")


async def say(ws, content: str, **sampling) -> Reply:
    await ws.send(json.dumps({"type": "message", "content": content, **sampling}))
    return await until_done(ws)


def wait_for(predicate, timeout: float = 10.0, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every)


@contextlib.contextmanager
def server_on(database: str, tmp: Path, env: dict[str, str]) -> Iterator[Server]:
    """A started server on a fresh SQLite file or PostgreSQL database ("sqlite" or
    "postgresql"); stopped, and its database dropped, afterwards."""
    if database == "sqlite":
        url, db = f"sqlite+aiosqlite:///{tmp}/pensieve.db", None
    else:
        services.ensure_postgres()
        db = services.create_database()
        url = services.pg_async_url(db)
    srv = Server(url, tmp / "server.log", env=env).start()
    try:
        yield srv
    finally:
        srv.stop()
        if db:
            services.drop_database(db)
