"""Who is asking: owner tokens from the Authorization header or the browser cookie."""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from pathlib import Path
from urllib.parse import urlsplit

from starlette.requests import HTTPConnection

OWNER_COOKIE = "pensieve_token"
ADMIN_COOKIE = "pensieve_admin"


def bearer(conn: HTTPConnection) -> str | None:
    value = conn.headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return None


def owner_token(conn: HTTPConnection) -> str | None:
    """The bearer token wins over the cookie, so a bot never acts as a browser session."""
    return bearer(conn) or conn.cookies.get(OWNER_COOKIE) or None


def is_admin(conn: HTTPConnection, admin_token: str) -> bool:
    given = bearer(conn) or conn.cookies.get(ADMIN_COOKIE) or ""
    return hmac.compare_digest(given.encode(), admin_token.encode())


def _origin_ok(origin: str, conn: HTTPConnection, allowed: list[str]) -> bool:
    origin = origin.rstrip("/")
    host = conn.headers.get("host", "")
    if origin in (f"http://{host}", f"https://{host}"):
        return True
    return origin in allowed or "*" in allowed


def origin_allowed(conn: HTTPConnection, allowed: list[str]) -> bool:
    """Browsers always send Origin on a WebSocket handshake; bots may not. A browser page from
    another site must not drive a chat with the user's cookie."""
    origin = conn.headers.get("origin")
    return origin is None or _origin_ok(origin, conn, allowed)


def same_origin_write(conn: HTTPConnection, allowed: list[str]) -> bool:
    """May this state-changing request act with the browser's cookies? Pages on another origin,
    another port of the same site included, may not (CSRF). A bearer token is never sent by a
    browser on its own, so such requests need no check. Browsers send Origin on every
    non-GET fetch and form post; Sec-Fetch-Site and Referer cover older ones. A request with
    none of them is not from a browser page."""
    if bearer(conn):
        return True
    origin = conn.headers.get("origin")
    if origin is not None:
        return _origin_ok(origin, conn, allowed)
    site = conn.headers.get("sec-fetch-site")
    if site is not None:
        return site in ("same-origin", "none")
    referer = conn.headers.get("referer")
    if referer:
        parts = urlsplit(referer)
        return _origin_ok(f"{parts.scheme}://{parts.netloc}", conn, allowed)
    return True


def admin_token_from_file(path: str | Path) -> str:
    """The admin token kept in `path`, made there (readable by this user only) on first use.
    It never reaches a log: the operator reads the file."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        token = path.read_text().strip()
        if not token:
            raise ValueError(f"the admin token file {path} is empty") from None
        if path.stat().st_mode & 0o077:
            logging.getLogger("pensieve").warning(
                "the admin token file %s is readable by other users; chmod 600 it", path
            )
        return token
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token
