"""A real `pensieve serve` in a subprocess, and a small WebSocket chat client for tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import httpx
import websockets

from bench.lib import harness
from tests import services

ADMIN = "test-admin-token"
# Small pools so that a few short chats already swap and drop chunks.
TINY = {"PENSIEVE_GPU_CACHE_CHUNKS": "24", "PENSIEVE_CPU_CACHE_CHUNKS": "32"}


@dataclass
class Server(harness.Server):
    """The tests' `pensieve serve`: on the CPU with the test admin token and short replies
    (unless `env` says otherwise), up once /healthz answers at all; REST helpers."""

    admin_token: str = ADMIN
    defaults: ClassVar[dict[str, str]] = {
        "PENSIEVE_DEVICE": "cpu",
        "PENSIEVE_DTYPE": "float32",  # what transformers computes, token for token
        "PENSIEVE_MAX_TOKENS_DEFAULT": "24",
    }

    # --- REST helpers ------------------------------------------------------------------
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
        db, url = services.new_database()
    srv = Server(url, tmp / "server.log", env=env).start()
    try:
        yield srv
    finally:
        srv.stop()
        if db:
            services.drop_database(db)
