"""`GET /v1/models` (with the context length, as vLLM reports it) and `GET /version`."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.openai.access import model_id, owner
from app.openai.errors import UNAVAILABLE, ApiError
from app.services import services
from app.turns.pipeline import DB_ERRORS


def server_version() -> str:
    try:
        return version("pensieve")
    except PackageNotFoundError:  # a checkout run without installing
        return "0+unknown"


async def list_models(request: Request) -> Response:
    try:
        await owner(request)
    except ApiError as e:
        return e.response()
    except DB_ERRORS:
        return UNAVAILABLE.response()
    sv = services(request)
    name = model_id(sv.settings)
    model = {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "pensieve",
        "root": name,
        "parent": None,
        "max_model_len": sv.engine.context_limit,
    }
    return JSONResponse({"object": "list", "data": [model]})


async def server_version_endpoint(request: Request) -> Response:
    """Open like vLLM's: benchmark clients ask it before anything else."""
    return JSONResponse({"version": server_version()})


routes = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/version", server_version_endpoint, methods=["GET"]),
]
