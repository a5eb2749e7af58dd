"""KV-aware routers a fleet puts in front of engines, as commands: vLLM's router
(`vllm-router --policy kv_aware`, from the `routers` extra) reads each replica's KV events
(`--kv-events-endpoint`, app/kv_events.py) and sends a request to the replica whose cache
holds the longest prefix of it, asking the replicas for a request's tokens
(`/v1/chat/completions/render`, else `/tokenize`). HAProxy (app/cluster/haproxy.py) stays the
default front: it hashes on the conversation instead."""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

ROUTERS = ("haproxy", "vllm-router", "dynamo")  # dynamo: app/cluster/dynamo.py
BLOCK_SIZE = 32  # the events' block: a chunk


@dataclass(frozen=True)
class Worker:
    url: str  # http://host:port
    events: str  # its KV events endpoint, tcp://host:port


def vllm_router_binary() -> str:
    """The router's launcher, beside this Python's (a venv's bin) or on PATH."""
    beside = Path(sys.executable).parent / "vllm-router"
    found = str(beside) if beside.exists() else shutil.which("vllm-router")
    if found is None:
        raise ValueError(
            "--router vllm-router: the vllm-router command is not installed "
            "(pip install 'pensieve[routers]')"
        )
    return found


def vllm_router_command(workers: list[Worker], host: str, port: int, model: str) -> list[str]:
    """vllm-router's KV-aware policy over `workers`, on host:port. Lower tiers are credited
    as vllm-router's defaults do (a CPU hit 0.8 of a GPU one): a conversation Pensieve moved
    to the CPU is swapped back in layer by layer, nearly as cheap as a GPU hit."""
    cmd = [vllm_router_binary(), "--host", host, "--port", str(port), "--policy", "kv_aware"]
    cmd += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", model]
    cmd += ["--health-check-endpoint", "/health", "--worker-urls", *[w.url for w in workers]]
    for w in workers:
        cmd += ["--kv-event-source", f"{w.url}={w.events}"]
    return cmd
