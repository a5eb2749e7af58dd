"""The chat socket under faults: clients that abort at any moment, a per-owner turn quota,
and PostgreSQL going away mid-chat. Real server, real PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import threading

import httpx
import pytest
import websockets

from tests import services
from tests.app_fixtures import TINY, Reply, Server, auth, connect, recv, say, until_done

pytestmark = pytest.mark.timeout(400)

ASGI_FAILURES = ("Exception in ASGI application", "Application shutdown failed")


@pytest.fixture
def pg_db(postgres):
    name = services.create_database()
    yield name
    services.drop_database(name)


async def _storm_one(server: Server, cid: str, token: str, rng: random.Random) -> None:
    """One connection that goes away at a random moment, often while being closed."""
    try:
        ws = await websockets.connect(server.ws + cid, additional_headers=auth(token))
    except (OSError, websockets.WebSocketException):
        return
    kind = rng.random()
    try:
        if kind < 0.3:  # a turn in flight when the client vanishes
            await ws.send(json.dumps({"type": "message", "content": "Hi", "max_tokens": 8}))
        elif kind < 0.6:  # a newer connection replaces this one while it aborts
            newer = asyncio.ensure_future(
                websockets.connect(server.ws + cid, additional_headers=auth(token))
            )
            await asyncio.sleep(rng.random() * 0.02)
            ws.transport.abort()
            other = await newer
            await asyncio.sleep(rng.random() * 0.02)
            other.transport.abort()
            return
        await asyncio.sleep(rng.random() * 0.05)
    except (OSError, websockets.WebSocketException):
        pass
    ws.transport.abort()


def test_connect_abort_storm_leaves_no_asgi_errors(pg_db, tmp_path):
    env = {**TINY, "PENSIEVE_TURNS_PER_MINUTE": "5"}
    server = Server(services.pg_async_url(pg_db), tmp_path / "server.log", env=env).start()
    try:
        token = server.user("stormy")
        chats = [server.new_chat(token) for _ in range(20)]
        rng = random.Random(10)

        async def storm() -> None:
            for _ in range(30):  # 300 connects in waves of 10
                await asyncio.gather(
                    *(_storm_one(server, rng.choice(chats), token, rng) for _ in range(10))
                )
            # DELETE while clients abort: every chat goes, none answers 500.
            for cid in chats[:10]:
                racer = asyncio.create_task(_storm_one(server, cid, token, rng))
                # What counts is the answer, not its speed (a loaded machine is slow)
                async with httpx.AsyncClient(timeout=30) as client:
                    r = await client.delete(
                        f"{server.url}/api/conversations/{cid}", headers=auth(token)
                    )
                await racer
                assert r.status_code == 204, r.text

        asyncio.run(storm())
        # The survivors still chat, and the owner's quota answers with a retry hint.
        quota_owner = server.user("counted")
        cid = server.new_chat(quota_owner)

        async def quota() -> list[dict]:
            async with connect(server, cid, quota_owner) as ws:
                for i in range(5):
                    r = await say(ws, f"Say {i}.", max_tokens=1)
                    assert r.errors == [] and r.done["finish_reason"] in ("stop", "length")
                await ws.send(json.dumps({"type": "message", "content": "One more."}))
                return [await recv(ws, timeout=30)]

        [refused] = asyncio.run(quota())
        assert refused["code"] == "rate_limited" and 0 < refused["retry_after_s"] <= 60
        assert [m["role"] for m in server.chat(quota_owner, cid)["messages"]] == [
            "user",
            "assistant",
        ] * 5
        for cid in chats[10:]:
            r = httpx.delete(f"{server.url}/api/conversations/{cid}", headers=auth(token))
            assert r.status_code == 204, r.text
    finally:
        server.stop()
    log = server.log_path.read_text(errors="replace")
    assert server.proc.returncode in (0, -15), log[-3000:]  # uvicorn re-raises SIGTERM
    for failure in ASGI_FAILURES:
        assert log.count(failure) == 0, log[-6000:]


class Proxy:
    """A TCP relay to PostgreSQL that can cut every connection and refuse new ones."""

    def __init__(self, port: int) -> None:
        self.target = (services.PG_HOST, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.up = True
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.up:
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            with self.lock:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self.up = False
        with self.lock:
            for s in self.conns:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            self.conns.clear()

    def restore(self) -> None:
        self.up = True

    def close(self) -> None:
        self.cut()
        self.listener.close()


async def _ask_until_the_database_is_back(ws, content: str) -> tuple[str, Reply]:
    """Send `content` until it is no longer answered `unavailable` (the pool reconnects once
    the database is back); returns the reply's first piece and the rest of it."""
    for _ in range(20):
        await ws.send(json.dumps({"type": "message", "content": content}))
        frame = await recv(ws, timeout=60)
        if frame["type"] == "error" and frame["code"] == "unavailable":
            await asyncio.sleep(0.5)
            continue
        assert frame["type"] == "token", frame
        rest = await until_done(ws)
        assert rest.errors == []
        return frame["text"], rest
    raise AssertionError("the chat did not recover after the database came back")


async def test_database_outage_mid_chat_answers_unavailable_then_recovers(pg_db, tmp_path):
    proxy = Proxy(services.PG_PORT)
    url = f"postgresql+asyncpg://{services.PG_USER}@127.0.0.1:{proxy.port}/{pg_db}"
    server = Server(url, tmp_path / "server.log", env=TINY).start()
    try:
        token = server.user("unlucky")
        cid = server.new_chat(token)
        async with connect(server, cid, token) as ws:
            first = await say(ws, "Hi! Name a colour.", max_tokens=8)
            assert first.errors == []
            proxy.cut()
            for _ in range(2):  # each message gets a clear answer, the socket stays up
                await ws.send(json.dumps({"type": "message", "content": "And another?"}))
                frame = await recv(ws, timeout=60)
                assert frame["type"] == "error" and frame["code"] == "unavailable", frame
            proxy.restore()
            first_piece, again = await _ask_until_the_database_is_back(ws, "Still there?")
        msgs = server.chat(token, cid)["messages"]
        # Nothing committed was lost; the refused messages were never stored.
        assert [(m["role"], m["content"]) for m in msgs] == [
            ("user", "Hi! Name a colour."),
            ("assistant", first.text),
            ("user", "Still there?"),
            ("assistant", first_piece + again.text),
        ]
    finally:
        server.stop()
        proxy.close()
    log = server.log_path.read_text(errors="replace")
    for failure in ASGI_FAILURES:
        assert log.count(failure) == 0, log[-6000:]


async def test_reply_lost_to_an_outage_leaves_a_closed_turn_not_a_dangling_question(
    pg_db, tmp_path
):
    """The database goes away while a reply streams: its question is stored, its reply cannot
    be. The next turn closes that turn with an empty `error` reply before its own question,
    so the history keeps the question and stays question/answer pairs."""
    proxy = Proxy(services.PG_PORT)
    url = f"postgresql+asyncpg://{services.PG_USER}@127.0.0.1:{proxy.port}/{pg_db}"
    server = Server(url, tmp_path / "server.log", env=TINY).start()
    try:
        token = server.user("midstream")
        cid = server.new_chat(token)
        async with connect(server, cid, token) as ws:
            frame = {"type": "message", "content": "Count to fifty.", "max_tokens": 64}
            await ws.send(json.dumps(frame))
            first = await recv(ws, timeout=120)
            assert first["type"] == "token", first
            proxy.cut()  # the question is stored; the reply will not be
            while True:
                frame = await recv(ws, timeout=120)
                if frame["type"] != "token":
                    break
            assert frame["type"] == "error" and frame["code"] == "unavailable", frame
            proxy.restore()
            _, again = await _ask_until_the_database_is_back(ws, "Still there?")
        msgs = server.chat(token, cid)["messages"]
        assert [(m["role"], m["finish_reason"]) for m in msgs] == [
            ("user", None),
            ("assistant", "error"),
            ("user", None),
            ("assistant", again.done["finish_reason"]),
        ]
        assert msgs[0]["content"] == "Count to fifty." and msgs[1]["content"] == ""
    finally:
        server.stop()
        proxy.close()
    log = server.log_path.read_text(errors="replace")
    for failure in ASGI_FAILURES:
        assert log.count(failure) == 0, log[-6000:]


async def test_full_engine_queue_answers_busy_and_takes_the_message_back(tmp_path):
    """With one turn running and one queued, a third is refused with `busy` and a retry hint;
    its user message is taken back, so the chat's history stays question/answer pairs."""
    db = f"sqlite+aiosqlite:///{tmp_path}/pensieve.db"
    env = {**TINY, "PENSIEVE_MAX_RUNNING": "1", "PENSIEVE_MAX_WAITING": "1"}
    server = Server(db, tmp_path / "server.log", env=env).start()
    try:
        token = server.user("queue")
        cids = [server.new_chat(token) for _ in range(4)]
        sockets = [await connect(server, cid, token).__aenter__() for cid in cids]
        frame = {"type": "message", "content": "Count to fifty.", "max_tokens": 48}
        await asyncio.gather(*(ws.send(json.dumps(frame)) for ws in sockets))
        outcomes = []
        for ws in sockets:
            first = await recv(ws, 120)
            if first["type"] == "error":
                outcomes.append(first)
            else:  # a token: the turn was taken; let it finish
                outcomes.append((await until_done(ws)).done)
        busy = [o for o in outcomes if o["type"] == "error"]
        assert busy and all(o["code"] == "busy" and o["retry_after_s"] > 0 for o in busy)
        assert any(o["type"] == "done" for o in outcomes)
        for cid, outcome in zip(cids, outcomes, strict=True):
            roles = [m["role"] for m in server.chat(token, cid)["messages"]]
            assert roles == ([] if outcome["type"] == "error" else ["user", "assistant"])
        # A refused chat works once the queue has room.
        refused = cids[outcomes.index(busy[0])]
        async with connect(server, refused, token) as ws:
            reply = await say(ws, "Hello again", max_tokens=4)
        assert reply.errors == [] and reply.done["finish_reason"] in ("stop", "length")
        for ws in sockets:
            await ws.close()
    finally:
        server.stop()
    assert "Traceback" not in server.log_tail(100_000)
