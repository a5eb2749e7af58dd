"""Hand-off: a request for a conversation whose home is another live replica is relayed
there, so a turn never rebuilds a cache another replica holds.

- `HandOff`, an ASGI middleware, relays the chat socket `/ws/chat/{id}` (a WebSocket
  relay, close codes passed on) and changes to `/api/conversations/{id}...` (HTTP; reads
  are SQL's, answered where they land).
- `forward_turn` relays a `/v1` request once it is matched to its conversation, naming the
  conversation in `X-Session-ID` so the home continues exactly that one.

A relayed request carries `X-Pensieve-Forwarded` (a MAC only replicas can make) and the
client's Host: the home serves it as if it had come to it directly, and never hands it on
again. A home that does not accept the connection is taken over (app/cluster/replica.py) and the
request is served here. The one-live-connection rule needs nothing more: every socket of a
chat ends at its home, whose Hub closes the older one with 4409.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re

import httpx
import websockets
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from app.cluster.directory import Home
from app.services import services

log = logging.getLogger("pensieve.cluster")

FORWARDED = "x-pensieve-forwarded"
CLIENT_HOST = "x-pensieve-host"
CONVERSATION_PATHS = (
    re.compile(r"^/ws/chat/([^/]+)$"),
    re.compile(r"^/api/conversations/([^/]+)(?:/.*)?$"),
)
# Headers a relay passes on (the rest are the relay's own: host, connection, upgrade...).
PASSED = frozenset(
    {
        "authorization", "cookie", "origin", "user-agent", "accept", "content-type",
        "x-session-id", "sec-fetch-site", "referer", "x-forwarded-for",
    }
)  # fmt: skip
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "server", "date"}
)
# The home went away mid-socket: the client reconnects (through the front) and lands on
# whichever replica takes the chat over.
HOME_GONE = 1012
MAX_TRIES = 3  # homes found unreachable in a row before serving here regardless
UNREACHABLE = (OSError, TimeoutError, httpx.ConnectError, httpx.ConnectTimeout)


def conversation_in(path: str) -> str | None:
    for pattern in CONVERSATION_PATHS:
        m = pattern.match(path)
        if m:
            return m.group(1)
    return None


def forwarded(request: Request) -> bool:
    """Did another replica hand this request over (so it is served here, as it is)?"""
    return bool(getattr(request.state, "forwarded", False))


def _headers(scope: Scope) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]


def _relay_headers(scope: Scope, key: str, **extra: str) -> dict[str, str]:
    headers = {k: v for k, v in _headers(scope) if k in PASSED}
    headers[FORWARDED] = key
    headers[CLIENT_HOST] = dict(_headers(scope)).get("host", "")
    client = scope.get("client")
    if client:
        before = headers.get("x-forwarded-for")
        headers["x-forwarded-for"] = f"{before}, {client[0]}" if before else client[0]
    headers.update(extra)
    return headers


def _accept_forwarded(scope: Scope, key: str) -> Scope:
    """A request marked as handed over by a replica: restore the client's Host (origin checks
    then judge it as the home would have judged it directly) and mark it forwarded. A mark
    that does not verify is removed, so nothing downstream sees it."""
    raw = scope["headers"]
    given = next((v for k, v in raw if k == FORWARDED.encode()), None)
    if given is None:
        return scope
    trusted = hmac.compare_digest(given, key.encode())
    host = next((v for k, v in raw if k == CLIENT_HOST.encode()), None)
    headers = [(k, v) for k, v in raw if k not in (FORWARDED.encode(), CLIENT_HOST.encode())]
    if trusted and host:
        headers = [(k, v) for k, v in headers if k != b"host"] + [(b"host", host)]
    scope = {**scope, "headers": headers}
    if trusted:
        scope["state"] = {**scope.get("state", {}), "forwarded": True}
    return scope


class HandOff:
    """ASGI middleware: relays chat sockets and conversation REST calls to the home replica."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        sv = getattr(scope["app"].state, "services", None)
        cluster = getattr(sv, "cluster", None)
        if cluster is None:
            return await self.app(scope, receive, send)
        scope = _accept_forwarded(scope, cluster.forward_key)
        cid = conversation_in(scope["path"])
        if cid is None or scope.get("state", {}).get("forwarded") or _read_only(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "http":
            body = await _read_body(receive, sv.settings.max_body_bytes)
            if body is None:  # too large for this route: refused by the app itself
                return await self.app(scope, _replay(b"", receive), send)
            receive = _replay(body, receive)
        home = await cluster.home_of(cid)
        for _ in range(MAX_TRIES):
            if home is None:
                break
            if scope["type"] == "websocket":
                relayed = await relay_socket(scope, receive, send, home, cluster)
            else:
                relayed = await relay_http(scope, body, receive, send, home, cluster)
            if relayed:
                return
            home = await cluster.home_unreachable(cid, home)
        await self.app(scope, receive, send)


def _read_only(scope: Scope) -> bool:
    """A read of a conversation (its stored history) is SQL's, whichever replica answers; a
    change (DELETE: close its socket, free its cache) is its home's."""
    return scope["type"] == "http" and scope["method"] in ("GET", "HEAD", "OPTIONS")


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks)
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            return None
        if not message.get("more_body"):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives `body` first (already read), then the client's messages."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


# --- WebSocket ---------------------------------------------------------------------------


def _ws_url(home: Home, scope: Scope) -> str:
    base = home.url.replace("https://", "wss://", 1).replace("http://", "ws://", 1)
    query = scope.get("query_string", b"").decode("latin-1")
    return base.rstrip("/") + scope["path"] + (f"?{query}" if query else "")


def _close_code(code: int | None) -> int:
    """A code that may be sent in a close frame for one the other side received."""
    if code is None or code in (1005, 1006, 1015):
        return HOME_GONE
    return code


async def relay_socket(scope: Scope, receive: Receive, send: Send, home: Home, cluster) -> bool:
    """Relay the client's socket to `home`; False when `home` did not accept a connection
    (nothing was sent to the client yet)."""
    try:
        upstream = await websockets.connect(
            _ws_url(home, scope),
            additional_headers=_relay_headers(scope, cluster.forward_key),
            open_timeout=3,
            max_size=None,
            compression=None,
            proxy=None,
            user_agent_header=None,
        )
    except UNREACHABLE:
        return False
    except InvalidHandshake as e:  # the home answered, but not as a socket
        log.warning("home %s refused a relayed socket: %r", home.replica, e)
        await receive()  # websocket.connect
        await send({"type": "websocket.close", "code": 1011, "reason": "relay refused"})
        return True
    async with upstream:
        message = await receive()
        if message["type"] != "websocket.connect":
            return True
        await send({"type": "websocket.accept"})
        to_home = asyncio.create_task(_client_to_home(receive, upstream))
        to_client = asyncio.create_task(_home_to_client(upstream, send))
        try:
            await asyncio.wait({to_home, to_client}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (to_home, to_client):
                task.cancel()
            await asyncio.gather(to_home, to_client, return_exceptions=True)
    return True


async def _client_to_home(receive: Receive, upstream) -> None:
    while True:
        message = await receive()
        if message["type"] == "websocket.receive":
            data = message.get("text")
            try:
                await upstream.send(data if data is not None else message.get("bytes") or b"")
            except ConnectionClosed:
                return  # the other task passes the home's close on
        elif message["type"] == "websocket.disconnect":
            code = message.get("code", 1000)
            valid = code in (1000, 1001) or 3000 <= code <= 4999
            await upstream.close(code if valid else 1000)
            return


async def _home_to_client(upstream, send: Send) -> None:
    try:
        async for data in upstream:
            key = "text" if isinstance(data, str) else "bytes"
            await send({"type": "websocket.send", key: data})
    except ConnectionClosed:
        pass
    code = _close_code(upstream.close_code)
    reason = upstream.close_reason or ("home replica went away" if code == HOME_GONE else "")
    with contextlib.suppress(Exception):  # the client may be gone already
        await send({"type": "websocket.close", "code": code, "reason": reason})


# --- HTTP --------------------------------------------------------------------------------


def _response(upstream: httpx.Response) -> Response:
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
    return StreamingResponse(
        upstream.aiter_raw(),
        status_code=upstream.status_code,
        headers=headers,
        background=BackgroundTask(upstream.aclose),
    )


async def _send_to(cluster, scope: Scope, body: bytes, home: Home, **extra: str):
    """The home's streamed response, or None when it did not accept a connection."""
    query = scope.get("query_string", b"").decode("latin-1")
    url = home.url.rstrip("/") + scope["path"] + (f"?{query}" if query else "")
    request = cluster.http.build_request(
        scope["method"], url, headers=_relay_headers(scope, cluster.forward_key, **extra),
        content=body,
    )  # fmt: skip
    try:
        return await cluster.http.send(request, stream=True)
    except UNREACHABLE:
        return None


async def relay_http(
    scope: Scope, body: bytes, receive: Receive, send: Send, home: Home, cluster
) -> bool:
    upstream = await _send_to(cluster, scope, body, home)
    if upstream is None:
        return False
    await receive()  # the body, read already: what follows is the client leaving
    await _response(upstream)(scope, receive, send)
    return True


async def forward_turn(request: Request, body: bytes, conversation_id: str) -> Response | None:
    """Relay a /v1 request to the home of the conversation it continues; None: serve it
    here."""
    cluster = services(request).cluster
    if cluster is None or forwarded(request):
        return None
    home = await cluster.home_of(conversation_id)
    for _ in range(MAX_TRIES):
        if home is None:
            return None
        upstream = await _send_to(
            cluster, request.scope, body, home, **{"x-session-id": conversation_id}
        )
        if upstream is not None:
            return _response(upstream)
        home = await cluster.home_unreachable(conversation_id, home)
    return None
