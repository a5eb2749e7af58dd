"""`pensieve cluster --router dynamo`: N Pensieve Dynamo workers (`python -m app.dynamo_worker`,
each with its KV events endpoint) behind Dynamo's frontend with its KV router on the cluster's
port (app/dynamo_worker/fleet.py, docs/dynamo.md). The workers are not `pensieve serve`
replicas: no database, no keys, no handoff; the frontend serves /v1 only. A worker that exits
is started again; Ctrl-C or SIGTERM stops them all."""

from __future__ import annotations

import importlib.util
import logging
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from app.cluster.launcher import stop_all
from app.dynamo_worker import fleet

log = logging.getLogger("pensieve.cluster")

START_TIMEOUT_S = 600.0
RESTART_DELAY_S = 2.0
MIGRATION_LIMIT = 3  # a turn whose worker died is retried on another
# serve settings a worker takes as flags
WORKER_FLAGS = ("device", "dtype", "gpu_cache_chunks", "cpu_cache_chunks", "cache_dir",
                "max_tokens_default")  # fmt: skip


@dataclass
class DynamoCluster:
    model: str
    options: dict[str, object]  # the workers' flags
    workers: int
    host: str
    port: int
    workdir: Path
    events: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)
    frontend: subprocess.Popen | None = None
    stopping: bool = False

    @property
    def store(self) -> Path:
        return self.workdir / "store"

    @property
    def frontend_log(self) -> Path:
        return self.workdir / "frontend.log"

    def start_worker(self, i: int) -> subprocess.Popen:
        args = fleet.worker_args(self.model, self.events[i], **self.options)
        # the workers' output is the launcher's own; the frontend's is read for readiness
        return subprocess.Popen(fleet.command(args), env=fleet.env(self.store), cwd=fleet.ROOT)

    def start(self) -> None:
        self.events = [f"tcp://127.0.0.1:{fleet.free_port()}" for _ in range(self.workers)]
        self.procs = [self.start_worker(i) for i in range(self.workers)]
        self.frontend = fleet.start(
            fleet.frontend_args(self.port, self.host, MIGRATION_LIMIT),
            self.frontend_log,
            fleet.env(self.store),
        )
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.stopping:
            dead = [p for p in [*self.procs, self.frontend] if p.poll() is not None]
            if dead:  # a worker that cannot start fails again: say so rather than loop
                raise RuntimeError(f"a Dynamo process exited {dead[0].returncode} on start "
                                   f"(frontend log: {self.frontend_log})")  # fmt: skip
            if fleet.ready(url, self.store, self.frontend_log, self.workers, self.model):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the Dynamo fleet did not come up")
            time.sleep(1.0)

    def supervise(self) -> int:
        """Until stopped: restart workers that exit; the frontend exiting ends the cluster."""
        down: dict[int, float] = {}
        while not self.stopping:
            if self.frontend.poll() is not None:
                log.error("the Dynamo frontend exited %s; stopping the cluster",
                          self.frontend.returncode)  # fmt: skip
                return 1
            for i, p in enumerate(self.procs):
                if p.poll() is None:
                    continue
                if i not in down:
                    log.warning("worker %d exited %s; restarting it", i, p.returncode)
                    down[i] = time.monotonic()
                elif time.monotonic() - down[i] >= RESTART_DELAY_S:
                    del down[i]
                    self.procs[i] = self.start_worker(i)
            time.sleep(0.2)
        return 0

    def stop(self) -> None:
        self.stopping = True
        stop_all([*self.procs, self.frontend])


def run(given: dict[str, object], workers: int, host: str, port: int) -> int:
    """The cluster of `workers` Dynamo workers with the serve settings `given`."""
    from app.settings import Settings

    if workers < 1:
        raise ValueError("--replicas must be at least 1")
    if importlib.util.find_spec("dynamo.frontend") is None:
        raise ValueError("--router dynamo: ai-dynamo is not installed (see docs/dynamo.md)")
    settings = Settings(**given)
    options = {k: given.get(k) for k in WORKER_FLAGS}
    with tempfile.TemporaryDirectory(prefix="pensieve-dynamo-") as tmp:
        cluster = DynamoCluster(settings.model, options, workers, host, port, Path(tmp))

        def stop(signum, frame) -> None:
            cluster.stopping = True

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        try:
            cluster.start()
            if cluster.stopping:
                return 0
            pids = ", ".join(str(p.pid) for p in cluster.procs)
            print(f"pensieve cluster on http://{host}:{port}: dynamo workers (pids {pids})",
                  flush=True)  # fmt: skip
            return cluster.supervise()
        finally:
            cluster.stop()
