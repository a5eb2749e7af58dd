"""The browser pages: chat at /, admin at /admin, assets under /static."""

from __future__ import annotations

import hmac
import importlib.util
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from app.auth import ADMIN_COOKIE, OWNER_COOKIE
from app.http import BadRequest, current_user, parse_body, problem
from app.limits import retry_after
from app.services import services

YEAR = 365 * 24 * 3600
SOURCE_ROOT = Path(__file__).resolve().parent.parent


def web_dir() -> Path:
    """The page assets: web/ of a source checkout, else the copy installed as the
    `pensieve_web` package (see pyproject.toml)."""
    if (SOURCE_ROOT / "pyproject.toml").is_file():
        return SOURCE_ROOT / "web"
    # A namespace package: its path may also hold an editable install's hook entry, so
    # take the first real directory that has the files.
    spec = importlib.util.find_spec("pensieve_web")
    for entry in spec.submodule_search_locations if spec else []:
        if (Path(entry) / "index.html").is_file():
            return Path(entry)
    raise RuntimeError("pensieve_web is not installed: reinstall pensieve")


WEB = web_dir()


def _page(name: str) -> FileResponse:
    return FileResponse(WEB / name, headers={"Cache-Control": "no-cache"})


async def chat_page(request: Request) -> Response:
    """The chat; a browser without a valid owner cookie gets a new owner here, at most
    `new_users_per_minute` per client address. HEAD never makes one."""
    response = _page("index.html")
    if request.method == "HEAD":
        return response
    if request.cookies.get(OWNER_COOKIE) and await current_user(request) is not None:
        return response
    sv = services(request)
    client = request.client.host if request.client else "unknown"
    wait = await sv.quotas.take("new-users", client, sv.settings.new_users_per_minute)
    if wait:
        return HTMLResponse(
            "<!doctype html><title>Pensieve</title><p>Too many new visitors from this address; "
            "try again in a minute.</p>",
            status_code=429,
            headers={"Retry-After": retry_after(wait), "Cache-Control": "no-store"},
        )
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
    """The admin page. It never takes the token from its URL (URLs reach logs and history):
    the page posts it to /admin/session, from its form or from the URL's #token= fragment."""
    return _page("admin.html")


class AdminLogin(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    token: str = Field(min_length=1, max_length=1000)


async def admin_session(request: Request) -> Response:
    """Exchanges the admin token for an HttpOnly cookie (204), or 401."""
    sv = services(request)
    try:
        login = await parse_body(request, AdminLogin)
    except BadRequest as e:
        return problem(e.status, e.code, e.message)
    if not hmac.compare_digest(login.token.encode(), sv.admin_token.encode()):
        return problem(401, "unauthorized", "that admin token was not accepted")
    response = Response(status_code=204)
    response.set_cookie(
        ADMIN_COOKIE,
        login.token,
        httponly=True,
        samesite="strict",
        secure=sv.settings.cookie_secure,
    )
    return response


routes = [
    Route("/", chat_page, methods=["GET"]),
    Route("/admin", admin_page, methods=["GET"]),
    Route("/admin/session", admin_session, methods=["POST"]),
    Mount("/static", StaticFiles(directory=WEB), name="static"),
]
