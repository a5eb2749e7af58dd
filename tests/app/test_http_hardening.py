"""Hostile and unlucky HTTP: bodies, CSRF, headers, user creation, quotas, tokens in logs and a
database that stops answering; against a real `pensieve serve` on PostgreSQL."""

from __future__ import annotations

import os
import select
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from bench.lib import harness
from bench.lib.harness import ROOT
from tests import services
from tests.app_fixtures import ADMIN, TINY, Server, auth

pytestmark = pytest.mark.timeout(300)

# The HTTP surface does not need a real model: the dummy one starts in seconds.
FAST = {"PENSIEVE_MODEL": "dummy:tiny", **TINY}  # small pools: ones sized from memory take seconds


@pytest.fixture(scope="module")
def pg_db(postgres):
    name = services.create_database()
    yield name
    services.drop_database(name)


@pytest.fixture(scope="module")
def server(pg_db, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("http")
    env = {
        **FAST,
        "PENSIEVE_NEW_USERS_PER_MINUTE": "3",
        "PENSIEVE_MAX_CHATS_PER_OWNER": "3",
        "PENSIEVE_ALLOWED_ORIGINS": "https://trusted.example",
    }
    srv = Server(services.pg_async_url(pg_db), tmp / "server.log", env=env, log_level="info")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def bot(server) -> str:
    """An owner whose chats stay empty."""
    return server.user("bot")


def count_users(pg_db: str) -> int:
    return int(services.psql("SELECT count(*) FROM users", pg_db))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


# --- security headers ---------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/", "/static/chat.js", "/api/conversations", "/healthz"])
def test_every_response_has_security_headers(server, path):
    r = httpx.get(server.url + path)
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["x-frame-options"] == "DENY"
    assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
    assert "default-src 'self'" in r.headers["content-security-policy"]
    assert r.headers["referrer-policy"] == "same-origin"


# --- owners made by page visits -------------------------------------------------------------


def test_head_never_makes_an_owner_and_page_visits_are_rate_limited(server, pg_db):
    before = count_users(pg_db)
    for _ in range(5):
        r = httpx.head(server.url + "/")
        assert r.status_code == 200 and "set-cookie" not in r.headers
    assert count_users(pg_db) == before
    codes = []
    for _ in range(5):  # 3 a minute per address
        r = httpx.get(server.url + "/")
        codes.append(r.status_code)
        if r.status_code == 200:
            assert "pensieve_token" in r.headers["set-cookie"]
        else:
            assert "set-cookie" not in r.headers
            assert 1 <= int(r.headers["retry-after"]) <= 60
    assert codes.count(429) >= 2 and codes[0] == 200
    assert count_users(pg_db) == before + codes.count(200)
    # A browser that has its cookie is never limited, and gets no new one.
    jar = httpx.Client(base_url=server.url)
    jar.cookies.set("pensieve_token", server.user("browser-like"))
    r = jar.get("/")
    assert r.status_code == 200 and "set-cookie" not in r.headers
    jar.close()


# --- request bodies -------------------------------------------------------------------------


def _raw_post(server: Server, headers: str, body_iter) -> tuple[bytes, int]:
    """POST over a raw socket, sending body pieces until the server answers; returns the
    response head and how many body bytes were sent."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    s.sendall(headers.encode())
    sent = 0
    try:
        for piece in body_iter:
            if select.select([s], [], [], 0)[0]:
                break
            s.sendall(piece)
            sent += len(piece)
    except OSError:
        pass  # the server answered and closed while we were still sending
    return _read_response(s), sent


def _read_response(s: socket.socket) -> bytes:
    """The whole response: its head and as much body as it declares (it may come in pieces)."""
    data = b""
    while True:
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            length = next(
                (
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ),
                0,
            )
            if len(body) >= length:
                break
        try:
            piece = s.recv(65536)
        except OSError:
            break
        if not piece:
            break
        data += piece
    s.close()
    return data


def test_a_huge_body_is_refused_without_being_read(server):
    token = server.user()
    before = rss_kib(server.proc.pid)
    mib = b"x" * (1 << 20)
    head = (
        "POST /api/conversations HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
    )
    # Declared: refused at once, before any of it is sent.
    resp, sent = _raw_post(server, head + "Content-Length: 314572800\r\n\r\n", [b""] + [mib] * 300)
    assert resp.startswith(b"HTTP/1.1 413"), resp[:200]
    assert b"at most 65536 bytes" in resp
    # Chunked, no length: refused once 64 KiB have arrived; far less than 300 MB is sent.
    chunks = (f"{len(mib):x}\r\n".encode() + mib + b"\r\n" for _ in range(300))
    resp, sent = _raw_post(server, head + "Transfer-Encoding: chunked\r\n\r\n", chunks)
    assert resp.startswith(b"HTTP/1.1 413"), resp[:200]
    assert sent < 100 << 20
    assert rss_kib(server.proc.pid) - before < 64 * 1024
    assert httpx.get(server.url + "/healthz").json()["status"] == "ok"


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ('{"title": "a\\u0000b"}', 400, "NUL"),
        ('{"system_prompt": "x\\u0000"}', 400, "NUL"),
        ('{"title": "\\ud800"}', 400, "not valid JSON"),
        ("[" * 5000 + "]" * 5000, 400, "not valid JSON"),
        ('{"title": ' + "[" * 100_000, 413, "at most"),
        ("[]", 400, "JSON object"),
        ('{"title": 5}', 400, "title"),
        ('{"colour": "red"}', 400, "unknown field: colour"),
        ('{"title": "' + "x" * 201 + '"}', 400, "200 characters"),
        ("{not json", 400, "not valid JSON"),
    ],
)
def test_bad_bodies_get_a_clear_400(server, bot, body, status, says):
    token = bot
    r = httpx.post(
        server.url + "/api/conversations",
        content=body.encode("utf-8", "surrogatepass"),
        headers={**auth(token), "Content-Type": "application/json"},
    )
    assert r.status_code == status, r.text
    assert says in r.json()["message"]
    assert httpx.get(server.url + "/api/conversations", headers=auth(token)).json() == {
        "conversations": []
    }


def test_bodies_must_be_json(server):
    token = server.user()
    r = httpx.post(
        server.url + "/api/conversations",
        content=b'{"title": "t"}',
        headers={**auth(token), "Content-Type": "text/plain"},
    )
    assert r.status_code == 415 and r.json()["error"] == "bad_content_type"
    # No body at all needs no type: a chat with defaults.
    assert httpx.post(server.url + "/api/conversations", headers=auth(token)).status_code == 201


def test_chats_per_owner_are_capped(server):
    token = server.user()
    for i in range(3):
        server.new_chat(token, title=f"chat {i}")
    r = httpx.post(server.url + "/api/conversations", json={}, headers=auth(token))
    assert r.status_code == 409 and r.json()["error"] == "too_many_chats"
    assert "at most 3 chats" in r.json()["message"]
    assert (
        len(
            httpx.get(server.url + "/api/conversations", headers=auth(token)).json()[
                "conversations"
            ]
        )
        == 3
    )


# --- CSRF --------------------------------------------------------------------------------------


def test_cookie_writes_from_another_origin_are_refused(server):
    token = server.user()
    own = server.url  # http://127.0.0.1:<port>
    other_port = f"http://127.0.0.1:{server.port + 1}"  # same site, another origin
    client = httpx.Client(base_url=server.url)
    client.cookies.set("pensieve_token", token)

    def post(**headers):
        return client.post("/api/conversations", json={}, headers=headers)

    assert post(Origin=other_port).status_code == 403
    assert post(Origin="null").status_code == 403
    assert post(**{"Sec-Fetch-Site": "same-site"}).status_code == 403
    assert post(Referer=other_port + "/evil.html").status_code == 403
    assert post(Origin=own).status_code == 201
    assert post(**{"Sec-Fetch-Site": "same-origin"}).status_code == 201
    assert post(Origin="https://trusted.example").status_code == 201  # PENSIEVE_ALLOWED_ORIGINS
    cid = client.get("/api/conversations").json()["conversations"][0]["id"]
    assert (
        client.delete(f"/api/conversations/{cid}", headers={"Origin": other_port}).status_code
        == 403
    )
    assert client.delete(f"/api/conversations/{cid}", headers={"Origin": own}).status_code == 204
    client.close()
    # A bot's bearer token is never sent by a browser on its own: no Origin needed, any accepted.
    r = httpx.post(server.url + "/api/conversations", json={}, headers=auth(token))
    assert r.status_code == 201
    r = httpx.post(
        server.url + "/api/conversations", json={}, headers={**auth(token), "Origin": other_port}
    )
    assert r.status_code == 409  # past the origin check: only the quota (3) stops it


# --- the admin token --------------------------------------------------------------------------


def test_tokens_never_reach_the_log(server):
    r = httpx.get(server.url + "/admin?token=SECRET-A&x=1", follow_redirects=False)
    assert r.status_code == 200 and "set-cookie" not in r.headers  # the URL grants nothing
    httpx.get(server.url + "/anything?access_token=SECRET-B&api_key=SECRET-C")
    httpx.get(server.url + "/healthz?x=1&password=SECRET-D")
    try:
        import websockets.sync.client as wsc

        with wsc.connect(server.ws + "nope?token=SECRET-E", open_timeout=5):
            pass
    except Exception:
        pass
    # The page exchanges the token for an HttpOnly cookie with a POST.
    client = httpx.Client(base_url=server.url)
    assert client.post("/admin/session", json={"token": "wrong"}).status_code == 401
    assert client.get("/api/admin/cache").status_code == 401
    r = client.post("/admin/session", json={"token": ADMIN})
    assert r.status_code == 204 and "httponly" in r.headers["set-cookie"].lower()
    assert client.get("/api/admin/cache").status_code == 200
    client.close()
    time.sleep(0.5)
    log = server.log_path.read_text()
    assert "/anything?access_token=[redacted]" in log  # the access log is on
    for secret in ("SECRET-A", "SECRET-B", "SECRET-C", "SECRET-D", "SECRET-E", ADMIN):
        assert secret not in log


def test_a_generated_admin_token_is_kept_in_a_private_file(tmp_path, pg_db):
    token_file = tmp_path / "secrets" / "admin-token"
    # An empty PENSIEVE_ADMIN_TOKEN is no token.
    env = {**FAST, "PENSIEVE_ADMIN_TOKEN": "", "PENSIEVE_ADMIN_TOKEN_FILE": str(token_file)}
    srv = Server(services.pg_async_url(pg_db), tmp_path / "server.log", env=env, log_level="info")
    srv.start()
    try:
        token = token_file.read_text().strip()
        assert len(token) >= 32
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert httpx.get(srv.url + "/api/admin/cache", headers=auth(token)).status_code == 200
    finally:
        srv.stop()
    log = srv.log_path.read_text()
    assert str(token_file) in log and token not in log
    # A restart keeps the same token.
    srv.start()
    try:
        assert httpx.get(srv.url + "/api/admin/cache", headers=auth(token)).status_code == 200
    finally:
        srv.stop()


# --- the database ---------------------------------------------------------------------------


class Blackhole:
    """A TCP proxy to PostgreSQL that can go dark: while dark it forwards nothing and answers
    nothing (a dropped network), then carries on."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.dark = threading.Event()
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._pump, args=(client,), daemon=True).start()

    def _pump(self, client: socket.socket) -> None:
        while self.dark.is_set() and not self.closed:
            time.sleep(0.05)  # accepted, never answered
        try:
            upstream = socket.create_connection(self.target)
        except OSError:
            client.close()
            return
        peers = {client: upstream, upstream: client}
        try:
            while not self.closed:
                if self.dark.is_set():
                    time.sleep(0.05)
                    continue
                for s in select.select(list(peers), [], [], 0.1)[0]:
                    data = s.recv(65536)
                    if not data:
                        return
                    peers[s].sendall(data)
        except OSError:
            return
        finally:
            client.close()
            upstream.close()

    def close(self) -> None:
        self.closed = True
        self.listener.close()


def test_a_blackholed_database_is_reported_fast_and_recovers(tmp_path, pg_db):
    hole = Blackhole(services.PG_HOST, services.PG_PORT)
    url = f"postgresql+asyncpg://{services.PG_USER}@127.0.0.1:{hole.port}/{pg_db}"
    env = {**FAST, "PENSIEVE_DATABASE_TIMEOUT_S": "2"}
    srv = Server(url, tmp_path / "server.log", env=env).start()
    try:
        token = srv.user()
        assert httpx.get(srv.url + "/healthz").json()["status"] == "ok"
        hole.dark.set()
        for _ in range(2):  # pooled connections hang, then new ones do
            t = time.monotonic()
            r = httpx.get(srv.url + "/healthz", timeout=30)
            assert time.monotonic() - t < 4
            assert r.status_code == 503
            assert r.json()["checks"]["database"]["status"] == "down"
        t = time.monotonic()
        r = httpx.get(srv.url + "/api/conversations", headers=auth(token), timeout=30)
        assert time.monotonic() - t < 8
        assert r.status_code == 503 and r.json()["error"] == "database_unavailable"
        assert r.headers["retry-after"]
        hole.dark.clear()
        deadline = time.monotonic() + 15
        while httpx.get(srv.url + "/healthz", timeout=30).status_code != 200:
            assert time.monotonic() < deadline, "the database never came back"
            time.sleep(0.2)
        r = httpx.post(srv.url + "/api/conversations", json={}, headers=auth(token))
        assert r.status_code == 201
    finally:
        srv.stop()
        hole.close()
    assert "Traceback" not in srv.log_tail(100_000)


def test_an_unreachable_database_at_start_is_one_line(tmp_path):
    port = harness.free_port()  # nothing listens there
    env = {k: v for k, v in os.environ.items() if not k.startswith("PENSIEVE_")}
    url = f"postgresql+asyncpg://postgres:hunter2@127.0.0.1:{port}/pensieve"
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "serve", "--database-url", url, "--port", "0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(
        f"pensieve: cannot reach the database at postgresql+asyncpg://postgres:***@127.0.0.1:{port}/pensieve: "
    )
    assert "hunter2" not in out.stderr
