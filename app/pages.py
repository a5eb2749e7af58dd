"""The browser pages: chat at /, admin at /admin, assets under /static."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from app.api import current_user
from app.auth import ADMIN_COOKIE, OWNER_COOKIE

WEB = Path(__file__).resolve().parent.parent / "web"
YEAR = 365 * 24 * 3600
# Pages load only their own scripts and styles and talk only to their own origin.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)


def _page(name: str) -> FileResponse:
    return FileResponse(
        WEB / name,
        headers={
            "Content-Security-Policy": CSP,
            "Cache-Control": "no-cache",
            "X-Content-Type-Options": "nosniff",
        },
    )


async def chat_page(request: Request) -> Response:
    """The chat; a browser without a valid owner cookie gets a new owner here."""
    response = _page("index.html")
    if request.cookies.get(OWNER_COOKIE) and await current_user(request) is not None:
        return response
    sv = request.app.state.services
    _, token = await sv.store.create_user("browser")
    response.set_cookie(
        OWNER_COOKIE,
        token,
        max_age=YEAR,
        httponly=True,
        samesite="strict",
        secure=sv.settings.cookie_secure,
    )
    return response


async def admin_page(request: Request) -> Response:
    """/admin?token=... keeps the admin token in an HttpOnly cookie and drops it from the URL."""
    token = request.query_params.get("token")
    if token is None:
        return _page("admin.html")
    sv = request.app.state.services
    response = RedirectResponse("/admin", status_code=303)
    response.set_cookie(
        ADMIN_COOKIE, token, httponly=True, samesite="strict", secure=sv.settings.cookie_secure
    )
    return response


routes = [
    Route("/", chat_page, methods=["GET"]),
    Route("/admin", admin_page, methods=["GET"]),
    Mount("/static", StaticFiles(directory=WEB), name="static"),
]
