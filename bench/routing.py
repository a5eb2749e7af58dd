"""Routing of returning turns: chats through a front (HAProxy, or vLLM's KV-aware router reading
Pensieve's KV events) to independent servers on one database, or through Dynamo's KV router to
Pensieve Dynamo workers; the share of returning turns that reach the server holding their KV
(one that does not recomputes the history: its reply reports no cached tokens).

    python -m bench.routing                                   # every front, with and without
                                                              # a session id, 20 chats x 3
    python -m bench.routing --router vllm-router --no-session --chats 8
    python -m bench.routing --router dynamo --out bench/results/routing_dynamo.json

The servers are not a `--cluster` (a replica would hand a turn to its home, hiding the
front's choice). Pools "roomy" (every chat's KV stays: a returning turn without cached
tokens was misrouted) and "tight" (chats swap and drop chunks). JSON and PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from app.cluster import haproxy
from app.cluster.routers import ROUTERS, Worker, vllm_router_command
from app.dynamo_worker import fleet as dynamo
from bench.lib.common import RESULTS, environment, write_json
from bench.lib.harness import PostgresServer, Server, free_port, wait_port

MODEL = "smollm2-135m-instruct"
WORDS = ["river", "stone", "cloud", "lantern", "meadow", "copper", "violin", "harbor"]


def message(run: str, chat: int, turn: int, words: int = 60) -> str:
    """A distinct user message: chats (of every run) differ from their first tokens on."""
    return f"{run} chat {chat}, turn {turn}: " + " ".join(
        WORDS[(chat * 7 + turn * 3 + k) % len(WORDS)] for k in range(words)
    )


POOLS = {"roomy": (96, 128), "tight": (24, 32)}  # GPU and CPU chunks per server


@dataclass
class Run:
    pools: str
    router: str
    session: bool
    chats: int
    turns: int
    returning: int = 0  # turns after a chat's first, answered
    hits: int = 0  # of those, the ones whose server held some of their KV
    cached_tokens: int = 0
    prompt_tokens: int = 0  # of the returning turns
    lost: int = 0  # turns that got no answer

    @property
    def hit_share(self) -> float:
        return self.hits / max(1, self.returning)


async def chat(client: httpx.AsyncClient, run: Run, i: int, key: str) -> None:
    messages: list[dict] = []
    headers = {"Authorization": f"Bearer {key}"}
    tag = f"{run.pools}-{run.router}{'+session' if run.session else ''}"
    if run.session:
        headers["X-Session-ID"] = f"routing-{tag}-{i}"
    for t in range(run.turns):
        messages.append({"role": "user", "content": message(tag, i, t)})
        body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
        try:
            r = await client.post("/v1/chat/completions", json=body, headers=headers)
            r.raise_for_status()
        except httpx.HTTPError:
            run.lost += 1
            return
        out = r.json()
        messages.append(out["choices"][0]["message"])
        if t:
            usage = out["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            run.returning += 1
            run.hits += cached > 0
            run.cached_tokens += cached
            run.prompt_tokens += usage["prompt_tokens"]


def front(router: str, servers: list[Server], workers: list[Worker], workdir: Path, port: int):
    """The front process on `port`."""
    if router == "haproxy":
        backends = [haproxy.Backend(f"s{i}", f"127.0.0.1:{s.port}") for i, s in enumerate(servers)]
        cfg = workdir / "haproxy.cfg"
        cfg.write_text(haproxy.config(backends, f"127.0.0.1:{port}", check_s=0.5))
        cmd = haproxy.command(str(cfg))
    else:
        cmd = vllm_router_command(workers, "127.0.0.1", port, MODEL)
    log = open(workdir / f"{router}.log", "ab")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    wait_port("127.0.0.1", port, timeout=60)
    return proc


async def replay(pools, router, session, args, servers, workers, key, workdir) -> Run:
    port = free_port()
    proc = front(router, servers, workers, workdir, port)
    try:
        return await drive(pools, router, session, args, f"http://127.0.0.1:{port}", key)
    finally:
        proc.terminate()
        proc.wait(10)


async def drive(pools: str, router: str, session: bool, args, url: str, key: str) -> Run:
    run = Run(pools, router, session, args.chats, args.turns)
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        await asyncio.gather(*(chat(c, run, i, key) for i in range(args.chats)))
    return run


def dynamo_runs(args, pools: str, sessions: list[bool], workdir: Path) -> list[Run]:
    """Dynamo's frontend over `args.servers` Pensieve Dynamo workers with `pools`' pools: one
    fleet for every session choice (the chats of each differ from their first tokens)."""
    gpu, cpu = POOLS[pools]
    fleet_dir = workdir / f"{pools}-dynamo"
    fleet_dir.mkdir(parents=True, exist_ok=True)
    with dynamo.running(
        fleet_dir, args.servers, MODEL, device="cpu", dtype="float32",
        gpu_cache_chunks=gpu, cpu_cache_chunks=cpu,
    ) as url:  # fmt: skip
        return [asyncio.run(drive(pools, "dynamo", s, args, url, "none")) for s in sessions]


def start_servers(args, pools: str, database_url: str, workdir: Path):
    """`args.servers` servers with `pools`' KV pools, and their KV events endpoints."""
    servers, workers = [], []
    gpu, cpu = POOLS[pools]
    for i in range(args.servers):
        events = f"tcp://127.0.0.1:{free_port()}"
        env = {
            "PENSIEVE_MODEL": MODEL,
            "PENSIEVE_DEVICE": "cpu",
            "PENSIEVE_DTYPE": "float32",
            "PENSIEVE_GPU_CACHE_CHUNKS": str(gpu),
            "PENSIEVE_CPU_CACHE_CHUNKS": str(cpu),
            "PENSIEVE_TURNS_PER_MINUTE": "100000",
            "PENSIEVE_KV_EVENTS_ENDPOINT": events,
        }
        s = Server(database_url, workdir / f"{pools}{i}.log", env=env).start(timeout=600)
        servers.append(s)
        workers.append(Worker(s.url, events))
    return servers, workers


def fleet_runs(args, pools: str, sessions: list[bool], database_url: str, workdir: Path):
    """Every front and session choice: one set of servers for HAProxy and vllm-router, one
    Dynamo fleet for Dynamo."""
    fronts = args.router or ROUTERS
    runs = dynamo_runs(args, pools, sessions, workdir) if "dynamo" in fronts else []
    others = [r for r in fronts if r != "dynamo"]
    if not others:
        return runs
    servers, workers = start_servers(args, pools, database_url, workdir)
    try:
        key = servers[0].user(f"routing-{pools}")
        return [
            asyncio.run(replay(pools, r, s, args, servers, workers, key, workdir))
            for r in others
            for s in sessions
        ] + runs
    finally:
        for s in servers:
            s.stop()


def plot(runs: list[Run], path: Path) -> None:
    from bench.lib.plots import plt, save_fig

    fig, ax = plt.subplots(figsize=(1.6 * len(runs) + 1, 3.4))
    labels = [f"{r.pools}\n{r.router}\n{'session' if r.session else 'no session'}" for r in runs]
    ax.bar(labels, [100 * r.hit_share for r in runs], color="#4c72b0")
    ax.axhline(95, color="#c44e52", linestyle="--", linewidth=1, label="95%")
    ax.set_ylabel("returning turns at their KV (%)")
    ax.set_ylim(0, 105)
    ax.legend(loc="lower right")
    save_fig(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--router", action="append", choices=ROUTERS, help="default: every front")
    p.add_argument("--session", action=argparse.BooleanOptionalAction, default=None,
                   help="send X-Session-ID (default: both ways)")  # fmt: skip
    p.add_argument("--chats", type=int, default=20)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--pools", action="append", choices=POOLS, help="default: both")
    p.add_argument("--out", type=Path, default=RESULTS / "routing.json")
    p.add_argument("--logs", type=Path, help="keep the servers' and fronts' logs here")
    args = p.parse_args(argv)
    sessions = [True, False] if args.session is None else [args.session]
    pg, runs = PostgresServer().init(), []
    try:
        for pools in args.pools or list(POOLS):
            if args.logs:
                args.logs.mkdir(parents=True, exist_ok=True)
                runs += fleet_runs(args, pools, sessions, pg.url, args.logs)
                continue
            with tempfile.TemporaryDirectory(prefix="pensieve-routing-") as tmp:
                runs += fleet_runs(args, pools, sessions, pg.url, Path(tmp))
    finally:
        pg.destroy()
    for r in runs:
        print(f"{r.pools:5s} {r.router:12s} session={r.session!s:5s} returning {r.returning:3d} "
              f"at their KV {r.hit_share:6.1%}  cached {r.cached_tokens}/{r.prompt_tokens} "
              f"lost {r.lost}")  # fmt: skip
    out = {
        "benchmark": "routing",
        "environment": environment("cpu"),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "runs": [{**asdict(r), "hit_share": round(r.hit_share, 4)} for r in runs],
    }
    write_json(args.out, out, indent=2)
    plot(runs, args.out.with_suffix(".png"))
    return 0 if all(r.lost == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
