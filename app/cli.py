"""`pensieve serve` and `pensieve users create NAME`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from app.settings import Settings

ENGINE_FLAGS = (
    ("model", str, "model name, Hugging Face model dir, or dummy:<shape>"),
    ("device", str, "cpu or cuda (default: cuda when present)"),
    ("dtype", str, "float32, bfloat16, float16 (default: per device)"),
    ("gpu_cache_chunks", int, "GPU KV cache size in chunks (default: from free memory)"),
    ("cpu_cache_chunks", int, "CPU KV cache size in chunks (default: from host memory)"),
    ("cache_mode", str, "pensieve | gpu | stateless"),
    ("eviction", str, "pensieve | lru"),
    ("max_batch_tokens", int, "token budget of one step"),
    ("database_url", str, "SQLAlchemy async URL (default: SQLite under ./data)"),
    ("redis_url", str, "Redis URL for activity times (default: none, in-process)"),
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pensieve", description="Stateful LLM chat server.")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the chat, REST API and admin pages")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    for name, kind, text in ENGINE_FLAGS:
        serve.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, help=text)
    serve.add_argument("--log-level", default="info")
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

    from app.main import create_app

    settings = _settings(args)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        ws_max_size=6 * settings.max_message_chars + 4096,  # \uXXXX-escaped content + JSON
    )


async def _create_user(url: str, name: str) -> str:
    from store import HistoryStore
    from store.migrate import upgrade_async

    await upgrade_async(url)
    store = HistoryStore(url)
    await store.start()
    try:
        user, token = await store.create_user(name)
    finally:
        await store.close()
    print(f"created user {user.name!r} (id {user.id}); its bearer token:")
    return token


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        if args.command == "serve":
            serve(args)
        elif args.command == "users":
            settings = _settings(args)
            token = asyncio.run(_create_user(settings.database_url, args.name))
            print(token)
    except ValueError as e:
        sys.exit(f"pensieve: {e}")


if __name__ == "__main__":
    main()
