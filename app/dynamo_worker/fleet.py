"""A Dynamo fleet as processes: Pensieve workers (`python -m app.dynamo_worker`) behind
`python -m dynamo.frontend --router-mode kv`, on loopback with file discovery
(docs/dynamo.md). Commands and environment only: importing this needs no Dynamo, so the
test and the cluster launcher share one recipe."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
PLANES = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", *args]


def env(store: Path) -> dict[str, str]:
    """Every process of one fleet reads discovery from `store`."""
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "DYN_FILE_KV": str(store),
        # loopback only: the request, response and event planes bind the host's address else
        "DYN_TCP_RPC_HOST": "127.0.0.1",
        "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
        "DYN_EVENT_PLANE_HOST": "127.0.0.1",
    }


def worker_args(model: str, events: str, **options: object) -> list[str]:
    """A worker publishing its KV events on `events` (tcp://HOST:PORT); `options` are its
    flags (gpu_cache_chunks=64: --gpu-cache-chunks 64), None left out."""
    args = ["app.dynamo_worker", "--model", model, "--kv-events-endpoint", events, *PLANES]
    for name, value in options.items():
        if value is not None:
            args += ["--" + name.replace("_", "-"), str(value)]
    return args


def frontend_args(port: int, host: str = "127.0.0.1", migration_limit: int = 0) -> list[str]:
    """`migration_limit` > 0: a request whose worker dies is sent to another (Dynamo's default
    0 answers it 503)."""
    http = ["--http-host", host, "--http-port", str(port)]
    migrate = ["--migration-limit", str(migration_limit)]
    return ["dynamo.frontend", *PLANES, "--router-mode", "kv", *http, *migrate]


def start(args: list[str], log: Path, environ: dict[str, str]) -> subprocess.Popen:
    """`python -m ARGS`, its output appended to `log`."""
    with log.open("ab") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            command(args),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=environ,
            cwd=ROOT,
        )


def instances(store: Path) -> int:
    d = store / "v1" / "instances"
    return len(list(d.iterdir())) if d.exists() else 0


def ready(url: str, store: Path, frontend_log: Path, workers: int, model: str) -> bool:
    """`workers` registered, the model served, and the router subscribed to each one's KV
    events (else its first turns are routed blind)."""
    if instances(store) < workers:
        return False
    try:
        models = httpx.get(url + "/v1/models", timeout=2).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    connected = frontend_log.read_text(errors="replace").count("stream connected")
    return [m["id"] for m in models] == [model] and connected >= workers


@contextlib.contextmanager
def running(
    workdir: Path, workers: int, model: str, timeout_s: float = 600, **options: object
) -> Iterator[str]:
    """`workers` workers (`options`: their flags) behind a frontend, logs and discovery under
    `workdir`; yields the frontend's URL once `ready`, stops them all after."""
    from app.cluster.launcher import stop_all

    environ = env(workdir / "store")
    procs = [
        start(worker_args(model, f"tcp://127.0.0.1:{free_port()}", **options),
              workdir / f"w{i}.log", environ)
        for i in range(workers)
    ]  # fmt: skip
    port = free_port()
    procs.append(start(frontend_args(port), workdir / "frontend.log", environ))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not ready(url, workdir / "store", workdir / "frontend.log", workers, model):
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a Dynamo process died: see {workdir}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Dynamo fleet did not come up: see {workdir}")
            time.sleep(1.0)
        yield url
    finally:
        stop_all(procs)
