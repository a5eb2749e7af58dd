"""Who is asking: owner tokens from the Authorization header or the browser cookie."""

from __future__ import annotations

import hmac

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


def origin_allowed(conn: HTTPConnection, allowed: list[str]) -> bool:
    """Browsers always send Origin on a WebSocket handshake; bots may not. A browser page from
    another site must not drive a chat with the user's cookie."""
    origin = conn.headers.get("origin")
    if origin is None:
        return True
    origin = origin.rstrip("/")
    host = conn.headers.get("host", "")
    if origin in (f"http://{host}", f"https://{host}"):
        return True
    return origin in allowed or "*" in allowed
