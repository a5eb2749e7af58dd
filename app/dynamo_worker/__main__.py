"""`python -m app.dynamo_worker --model NAME --kv-events-endpoint tcp://HOST:PORT`: Pensieve's
engine in process, registered with NVIDIA Dynamo (docs/dynamo.md).

Its KV events are published on `--kv-events-endpoint` in vLLM's format (app/kv_events.py);
Dynamo's `KvEventPublisher` subscribes to them there and relays them on Dynamo's event plane,
announced in discovery for this worker, where the frontend's KV router reads them."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from app.dynamo_worker.card import card_dir
from app.dynamo_worker.handler import Handler
from app.kv_events import Publisher
from engine.async_engine import AsyncEngine
from engine.types import EngineConfig

log = logging.getLogger("pensieve.dynamo")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m app.dynamo_worker", description=__doc__)
    env = os.environ.get
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--served-model-name", help="the name clients ask for (default: --model)")
    p.add_argument("--kv-events-endpoint", help="ZMQ PUB endpoint of the KV events (off: none)")
    p.add_argument("--kv-events-replay-endpoint")
    p.add_argument("--endpoint", default="pensieve.backend.generate", help="ns.component.name")
    p.add_argument("--discovery-backend", default=env("DYN_DISCOVERY_BACKEND", "file"))
    p.add_argument("--request-plane", default=env("DYN_REQUEST_PLANE", "tcp"))
    p.add_argument("--event-plane", default=env("DYN_EVENT_PLANE", "zmq"))
    p.add_argument("--device")
    p.add_argument("--dtype")
    p.add_argument("--gpu-cache-chunks", type=int)
    p.add_argument("--cpu-cache-chunks", type=int)
    p.add_argument("--cache-dir")
    p.add_argument("--max-tokens-default", type=int, default=512)
    return p.parse_args(argv)


def local(endpoint: str) -> str:
    """Where a subscriber on this host connects to a bound endpoint."""
    return endpoint.replace("*", "127.0.0.1").replace("0.0.0.0", "127.0.0.1")


async def serve(args: argparse.Namespace) -> None:
    # imported here: only this worker needs Dynamo installed
    from dynamo.llm import KvEventPublisher, ModelInput, ModelType, WorkerType, register_model
    from dynamo.runtime import DistributedRuntime

    config = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        gpu_cache_chunks=args.gpu_cache_chunks,
        cpu_cache_chunks=args.cpu_cache_chunks,
        cache_dir=args.cache_dir,
        kv_events=args.kv_events_endpoint is not None,
    )
    config.validate()
    engine = AsyncEngine(config)  # no history store: the engine keeps the token history
    await engine.start()
    publisher = None
    if args.kv_events_endpoint:
        publisher = Publisher(
            engine.kv_events,
            config.chunk_size,
            args.kv_events_endpoint,
            args.kv_events_replay_endpoint,
        )
        publisher.start()
    await engine.warm_up(engine.tokenizer.encode("Hello"))

    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(
        loop, args.discovery_backend, args.request_plane, event_plane=args.event_plane
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, runtime.shutdown)
    endpoint = runtime.endpoint(args.endpoint)
    relay = None
    if args.kv_events_endpoint:
        relay = KvEventPublisher(
            endpoint,
            kv_block_size=config.chunk_size,
            zmq_endpoint=local(args.kv_events_endpoint),
            zmq_topic="",
        )
    await register_model(
        ModelInput.Tokens,  # the frontend applies the template and tokenizes
        ModelType.Chat | ModelType.Completions,
        endpoint,
        str(card_dir(args.model, args.cache_dir)),
        args.served_model_name or args.model,
        worker_type=WorkerType.Aggregated,
        kv_cache_block_size=config.chunk_size,
    )
    handler = Handler(engine, args.max_tokens_default)
    log.info("pensieve dynamo worker ready: %s on %s", args.model, args.endpoint)
    try:
        await endpoint.serve_endpoint(handler.generate)
    finally:
        log.info("pensieve dynamo worker stopping: %s", handler.counters)
        if relay is not None:
            relay.shutdown()
        if publisher is not None:
            publisher.stop()
        await engine.stop()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(serve(parse()))


if __name__ == "__main__":
    main()
