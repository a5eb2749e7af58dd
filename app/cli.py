"""`pensieve serve`, `pensieve cluster` and `pensieve users create NAME`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import types
import typing

from pydantic import ValidationError

from app.cluster.routers import ROUTERS
from app.settings import ENGINE_HELP, Settings, engine_fields

SERVER_FLAGS = (
    ("database_url", str, "SQLAlchemy async URL (default: SQLite under ./data)"),
    ("database_timeout_s", float, "bound of each database connect, statement and checkout"),
    ("redis_url", str, "Redis URL for activity times (default: none, in-process)"),
    ("chat_template", str, "a Jinja chat template file to serve instead of the model's own"),
    (
        "reencode_replies",
        bool,
        "re-encode a reply the template renders differently in history "
        "(a thinking model's) when it ends, so the next turn reuses the history (default on)",
    ),
    (
        "kv_events_endpoint",
        str,
        "publish KV events (where each conversation's chunks live) on this ZMQ endpoint, "
        "tcp://HOST:PORT, in vLLM's format for Dynamo's, vLLM's and llm-d's routers",
    ),
    ("kv_events_replay_endpoint", str, "a ZMQ endpoint that replays recent KV events"),
    ("kv_events_topic", str, "the topic of every KV events frame (default: none)"),
)
REPLICA_FLAGS = (
    ("cluster", bool, "run as a replica: join the conversation directory in Redis"),
    ("replica_id", str, "this replica's id in the cluster (default host:port)"),
    ("replica_url", str, "the URL other replicas reach this one at (default http://host:port)"),
)


def _flag_type(kind: object) -> object:
    """The argparse type of a field type: `int | None` -> int; bool -> a --x/--no-x switch."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    return kind


def _add_flag(p: argparse.ArgumentParser, name: str, kind: object, text: str | None) -> None:
    flag = "--" + name.replace("_", "-")
    kind = _flag_type(kind)
    if kind is bool:
        p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, help=text)
    else:
        p.add_argument(flag, dest=name, type=kind, help=text)


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    for name, kind, _ in engine_fields():
        _add_flag(p, name, kind, ENGINE_HELP.get(name))
    for name, kind, text in SERVER_FLAGS:
        _add_flag(p, name, kind, text)
    p.add_argument("--log-level", default="info")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pensieve", description="Stateful LLM chat server.")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the chat, REST API and admin pages")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    _add_server_flags(serve)
    for name, kind, text in REPLICA_FLAGS:
        _add_flag(serve, name, kind, text)
    cluster = sub.add_parser(
        "cluster", help="N replicas and a front (HAProxy, or a KV-aware router), on this machine"
    )
    cluster.add_argument("--replicas", type=int, default=2, help="replicas to start (default 2)")
    cluster.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    cluster.add_argument(
        "--port", type=int, default=8000, help="the front's port; replicas take P+1..P+N"
    )
    cluster.add_argument(
        "--router",
        choices=ROUTERS,
        default="haproxy",
        help="the front: haproxy (hashes on the conversation; default), vllm-router (its "
        "KV-aware policy over the replicas' KV events) or dynamo (Dynamo's frontend and KV "
        "router over N Pensieve Dynamo workers instead of replicas; /v1 only)",
    )
    _add_server_flags(cluster)
    users = sub.add_parser("users", help="manage owners")
    users_sub = users.add_subparsers(dest="users_command", required=True)
    create = users_sub.add_parser("create", help="create an owner; its token is the last line")
    create.add_argument("name")
    create.add_argument("--database-url", dest="database_url")
    return p


def _settings(args: argparse.Namespace) -> Settings:
    given = {k: v for k, v in vars(args).items() if v is not None and k in Settings.model_fields}
    return Settings(**given)


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from app.logs import redact_access_logs
    from app.main import create_app
    from app.socket.chat import ws_max_size
    from store.db import check_database

    settings = _settings(args)
    # Fail in one line, before the model loads, when the database cannot be reached.
    asyncio.run(check_database(settings.database_url, settings.database_timeout_s))
    logging.getLogger("alembic").setLevel(logging.WARNING)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = _with_serving_dtype(settings)
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        ws_max_size=ws_max_size(settings.max_message_chars),
    )
    redact_access_logs()  # after uvicorn.Config set up its loggers
    uvicorn.Server(config).run()


def _with_serving_dtype(settings: Settings) -> Settings:
    """A dtype left unset is picked for the device, in one log line saying which and why;
    with it, where weights are "auto", the weights (float16 linears where the CPU serves
    float32)."""
    from engine.backends.local import serving_dtype, serving_weights

    if settings.dtype is not None:
        return settings
    if settings.weights in ("bfloat16", "float32"):  # dequantized weights name their dtype
        return settings.model_copy(update={"dtype": settings.weights})
    if settings.weights == "float16":  # float16 linears compute in float32
        return settings.model_copy(update={"dtype": "float32"})
    log = logging.getLogger(__name__)
    dtype, why = serving_dtype(settings.device)
    log.info("dtype %s: %s", dtype, why)
    update = {"dtype": dtype}
    if settings.weights == "auto":
        weights, why = serving_weights(settings.device, dtype)
        if weights != "auto":
            log.info("weights %s: %s", weights, why)
            update["weights"] = weights
    return settings.model_copy(update=update)


async def _create_user(settings: Settings, name: str) -> str:
    from store import HistoryStore
    from store.db import check_database
    from store.migrate import upgrade_async

    await check_database(settings.database_url, settings.database_timeout_s)
    await upgrade_async(settings.database_url)
    store = HistoryStore(settings.database_url, timeout_s=settings.database_timeout_s)
    await store.start()
    try:
        user, token = await store.create_user(name)
    finally:
        await store.close()
    print(f"created user {user.name!r} (id {user.id}); its bearer token:")
    return token


def _cluster(args: argparse.Namespace) -> int:
    from app.cluster import launcher

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    skip = {"host", "port", "replicas", "log_level", "router"}
    given = {
        k: v
        for k, v in vars(args).items()
        if v is not None and k in Settings.model_fields and k not in skip
    }
    try:
        if args.router == "dynamo":
            from app.cluster import dynamo

            return dynamo.run(given, args.replicas, args.host, args.port)
        return launcher.run(given, args.replicas, args.host, args.port, args.log_level, args.router)
    except RuntimeError as e:  # a replica that would not start
        sys.exit(f"pensieve: {e}")


def _one_line(e: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(map(str, err['loc'])) or 'settings'}: {err['msg']}" for err in e.errors()
    )


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        if args.command == "serve":
            serve(args)
        elif args.command == "cluster":
            sys.exit(_cluster(args))
        elif args.command == "users":
            token = asyncio.run(_create_user(_settings(args), args.name))
            print(token)
    except ValidationError as e:
        sys.exit(f"pensieve: {_one_line(e)}")
    except (ValueError, ConnectionError) as e:
        sys.exit(f"pensieve: {e}")


if __name__ == "__main__":
    main()
