"""Soak test: a real `pensieve serve` on its own PostgreSQL and Redis, driven through faults.

    python -m bench.soak                          # 200 chats, storms, Redis and PostgreSQL faults
    python -m bench.soak --conversations 20 --duration 60 --storm 200 --faults redis
    python -m bench.soak --no-faults

Chat workers hold short turns over the WebSocket for `--duration` s while storms open sockets
and drop them (idle, mid-turn, mid-handshake, during the close, by TCP reset, or reset and
reconnect) and the fault schedule stops and restarts Redis and PostgreSQL. Then every chat
must take one more turn, every `done` the client saw must be stored with the streamed text,
histories must be well formed, the storm's chats must DELETE with 204, SIGTERM must shut the
server down cleanly, and its log must hold no exception. JSON and PNG; exit status 1 when a
check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import random
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import websockets
from websockets.exceptions import ConnectionClosed

from bench.lib.common import environment, write_json
from bench.lib.harness import (
    HOST,
    ROOT,
    PostgresServer,
    RedisServer,
    Server,
    ServiceError,
    port_open,
)
from bench.lib.soak_clients import (
    HTTP_S,
    TURN_S,
    Tally,
    chat_workers,
    closed_reason,
    connect,
    health_probe,
    reset,
    storm,
    storm_times,
    tally_json,
    visit,
)

FAULTS = ("redis", "postgres-fast", "postgres-immediate", "postgres-freeze")
DEFAULT_FAULTS = ("redis", "postgres-fast", "postgres-immediate")
SHUTDOWN_S = 30.0


# --- processes the soak owns ----------------------------------------------------------------

_cleanups: list[Any] = []


def _cleanup_all() -> None:
    while _cleanups:
        with contextlib.suppress(Exception):
            _cleanups.pop()()


atexit.register(_cleanup_all)


def fault_schedule(faults: list[str], duration: float) -> list[tuple[str, float, float]]:
    """Each fault gets an equal slot of [15%, 85%] of the run and is on for 60% of it."""
    if not faults:
        return []
    slot = 0.7 * duration / len(faults)
    return [(f, 0.15 * duration + i * slot, 0.15 * duration + i * slot + 0.6 * slot)
            for i, f in enumerate(faults)]  # fmt: skip


async def run_faults(schedule, pg: PostgresServer, redis: RedisServer, tally: Tally) -> None:
    actions = {
        "redis": (redis.kill, redis.start),
        "postgres-fast": (lambda: pg.stop("fast"), pg.start),
        "postgres-immediate": (lambda: pg.stop("immediate"), pg.start),
        "postgres-freeze": (pg.freeze, pg.thaw),
    }
    for kind, start, end in schedule:
        down, up = actions[kind]
        await asyncio.sleep(max(0.0, start - tally.now()))
        window = {"fault": kind, "start_s": round(tally.now(), 2)}
        tally.fault_windows.append(window)
        try:
            await asyncio.to_thread(down)
        except ServiceError as e:
            tally.fault_errors.append(f"{kind} stop: {e}")
        await asyncio.sleep(max(0.0, end - tally.now()))
        try:
            await asyncio.to_thread(up)
        except ServiceError as e:
            tally.fault_errors.append(f"{kind} restart: {e}")
        window["end_s"] = round(tally.now(), 2)


def restore(pg: PostgresServer, redis: RedisServer) -> None:
    """Bring both services back, should a fault window have been cut short."""
    pg.thaw()
    if not port_open(HOST, pg.port):
        pg.start()
    if redis.proc is None or redis.proc.poll() is not None:
        redis.start()


async def wait_healthy(http: httpx.AsyncClient, timeout: float) -> float | None:
    """Seconds until /healthz says ok (database and Redis back), or None."""
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            r = await http.get("/healthz")
            if r.status_code == 200 and r.json().get("status") == "ok":
                return round(time.monotonic() - t, 2)
        await asyncio.sleep(0.5)
    return None


async def final_turns(base, token, chats, tally, args) -> dict[str, str]:
    """One turn on every chat, `args.workers` at a time; chat -> outcome. Bounded: chats not
    reached in time count as "not_reached"."""
    gate = asyncio.Semaphore(args.workers)
    outcomes: dict[str, str] = {}

    async def one(i: int, cid: str) -> None:
        async with gate:
            outcomes[cid] = await visit(base, cid, token, 1, 10**6 + i, tally, args.max_tokens)

    tasks = [asyncio.create_task(one(i, c)) for i, c in enumerate(chats)]
    _, pending = await asyncio.wait(tasks, timeout=TURN_S + 3.0 * len(chats))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return {c: outcomes.get(c, "not_reached") for c in chats}


async def verify(http: httpx.AsyncClient, chats: list[str], tally: Tally) -> dict[str, Any]:
    """Every done the client saw is stored with its streamed text; histories are well formed."""
    lost, mismatched, unreadable = 0, 0, []
    inconsistent: list[str] = []
    stored_messages = 0
    for cid in chats:
        try:
            r = await http.get(f"/api/conversations/{cid}")
            r.raise_for_status()
            messages = r.json()["messages"]
        except (httpx.HTTPError, ValueError, KeyError) as e:
            unreadable.append(f"{cid}: {type(e).__name__}: {e}")
            lost += len(tally.seen.get(cid, {}))
            continue
        stored_messages += len(messages)
        by_id = {m["id"]: m for m in messages}
        for mid, text in tally.seen.get(cid, {}).items():
            if mid not in by_id:
                lost += 1
            elif by_id[mid]["content"] != text:
                mismatched += 1
        seqs = [m["seq"] for m in messages]
        roles = [m["role"] for m in messages]
        if len(set(seqs)) != len(seqs) or seqs != sorted(seqs):
            inconsistent.append(f"{cid}: seqs {seqs}")
        expected = ["user", "assistant"] * (len(roles) // 2 + 1)
        if roles != expected[: len(roles)] or len(roles) % 2:
            inconsistent.append(f"{cid}: roles {''.join(r[0] for r in roles)}")
    return {
        "lost_messages": lost,
        "mismatched_messages": mismatched,
        "inconsistent_chats": len(inconsistent),
        "inconsistent_samples": inconsistent[:10],
        "unreadable_chats": len(unreadable),
        "unreadable_samples": unreadable[:5],
        "stored_messages": stored_messages,
    }


def terminate(server: Server) -> dict[str, Any]:
    """SIGTERM; the shutdown is clean when the process exits 0 within SHUTDOWN_S."""
    t = time.monotonic()
    code = server.stop(SHUTDOWN_S)
    if code is None:
        return {"clean": False, "exit_code": None, "seconds": SHUTDOWN_S, "hung": True}
    # uvicorn re-raises the signal once it has shut down: -SIGTERM is a normal exit.
    clean = code in (0, -signal.SIGTERM)
    return {"clean": clean, "exit_code": code, "seconds": round(time.monotonic() - t, 2)}


async def shutdown(server: Server, base: str, token: str, chats: list[str]) -> dict[str, Any]:
    """SIGTERM while sockets are open: some mid-turn, some reset just before the signal."""
    socks = []
    for cid in chats[:6]:
        with contextlib.suppress(TimeoutError, OSError, websockets.InvalidHandshake):
            socks.append(await connect(base, cid, token))
    for i, ws in enumerate(socks):
        with contextlib.suppress(ConnectionClosed, OSError, TimeoutError):
            if i % 2:
                msg = {"type": "message", "content": "Hello.", "max_tokens": 8}
                await asyncio.wait_for(ws.send(json.dumps(msg)), 5)
    await asyncio.sleep(0.2)
    for ws in socks[:2]:  # gone, and the server may only learn it while closing them
        reset(ws)
        ws.transport.abort()
    result = await asyncio.to_thread(terminate, server)
    codes: Counter = Counter()
    for ws in socks[2:]:
        try:
            while True:
                await asyncio.wait_for(ws.recv(), 5)
        except ConnectionClosed as e:
            codes[closed_reason(e)] += 1
        except (TimeoutError, OSError):
            codes["no_close"] += 1
        ws.transport.abort()
    result["open_sockets_saw"] = dict(codes)
    return result


# --- the server's log -------------------------------------------------------------------------

PATTERNS = (
    "Exception in ASGI application",
    "Application shutdown failed",
    "Application startup failed",
    "Task exception was never retrieved",
    "Traceback (most recent call last)",
)
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
_ERROR_RECORD = re.compile(r"^(ERROR|CRITICAL):|^\S+ \S+ (ERROR|CRITICAL) ")


def scan_log(text: str) -> dict[str, Any]:
    """Counts of the patterns, of error records and of distinct exceptions. `asgi_exceptions`
    counts error events: ASGI/lifespan failures plus tracebacks not already part of one."""
    lines = text.splitlines()
    counts = {p: sum(p in line for line in lines) for p in PATTERNS}
    events = sum(counts[p] for p in PATTERNS[:4])
    exceptions: Counter = Counter()
    headlines: Counter = Counter()
    prev = ""
    for i, line in enumerate(lines):
        if _ERROR_RECORD.search(line):
            headline = line.split(": ", 1)[-1].strip()
            headlines[re.sub(r"[0-9a-f]{32}|\d+", "N", headline)[:160]] += 1
        if "Traceback (most recent call last)" in line:
            if not any(p in prev for p in (*PATTERNS[:4], *_CHAINED)):
                events += 1
            j = i + 1  # the first unindented line after the frames names the exception
            while j < len(lines) and (not lines[j] or lines[j].startswith((" ", "\t"))):
                j += 1
            if j < len(lines):
                exceptions[lines[j][:200]] += 1
        if line.strip():
            prev = line
    return {
        "asgi_exceptions": events,
        "patterns": counts,
        "error_records": sum(headlines.values()),
        "error_headlines": dict(headlines.most_common(15)),
        "exceptions": dict(exceptions.most_common(15)),
    }


# --- the run ----------------------------------------------------------------------------------


async def drive(
    args, server: Server, pg: PostgresServer, redis: RedisServer, token: str, out: dict
) -> None:
    """Fills `out` as it goes, so what was measured survives a failure part-way."""
    base = server.url
    headers = {"Authorization": f"Bearer {token}"}
    tally = Tally()
    out["tally"] = tally
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=HTTP_S) as http:

        async def create(title: str) -> str:
            r = await http.post("/api/conversations", json={"title": title})
            if r.status_code != 201:
                raise ServiceError(f"POST /api/conversations: {r.status_code} {r.text[:200]}")
            return r.json()["id"]

        chats = [await create(f"soak {i}") for i in range(args.conversations)]
        # The storm hits some of those chats and as many of its own, deleted at the end: a
        # socket the server failed to forget shows up as a failed DELETE.
        rng = random.Random(args.seed + 2)
        shared = rng.sample(chats, min(len(chats), (args.storm_chats + 1) // 2))
        own = [
            await create(f"storm {i}") for i in range(args.storm_chats // 2 if args.storm else 0)
        ]
        schedule = fault_schedule([] if args.no_faults else args.faults, args.duration)
        tally.t0 = time.monotonic()
        stages = [
            chat_workers(base, token, chats, tally, args.duration, args),
            storm(base, token, shared + own, tally,
                  storm_times(schedule, args.duration, args.storm_bursts), args),
            run_faults(schedule, pg, redis, tally),
            health_probe(http, tally, args.duration),
        ]  # fmt: skip
        try:
            await asyncio.wait_for(asyncio.gather(*stages), args.duration + TURN_S + 120)
        except TimeoutError:
            out["stalled"] = "the main phase did not end in time"
        out["main_phase_s"] = round(tally.now(), 1)
        out["turns_ok"] = tally.turns_ok
        await asyncio.to_thread(restore, pg, redis)
        out["recovery_s"] = await wait_healthy(http, 90)
        out["final_phase_start_s"] = round(tally.now(), 1)
        outcomes = await final_turns(base, token, chats, tally, args)
        unusable = [o for o in outcomes.values() if o != "ok"]
        out.update(await verify(http, chats, tally))
        deletes: Counter = Counter()
        for cid in own:
            try:
                deletes[str((await http.delete(f"/api/conversations/{cid}")).status_code)] += 1
            except httpx.HTTPError as e:
                deletes[type(e).__name__] += 1
        out["storm_chat_deletes"] = dict(deletes)
        out.update(
            conversations=len(chats),
            final_turns_ok=len(chats) - len(unusable),
            usable_chats=len(chats) - len(unusable),
            unusable_chats=len(unusable),
            unusable_reasons=dict(Counter(unusable)),
        )
        out["shutdown"] = await shutdown(server, base, token, chats)


CHECKS = (
    ("lost_messages", "{} committed messages lost"),
    ("mismatched_messages", "{} stored replies differ from the streamed text"),
    ("unusable_chats", "{} chats unusable after the faults"),
    ("inconsistent_chats", "{} chats with a malformed history"),
    ("unreadable_chats", "{} chats could not be read back"),
    ("asgi_exceptions", "{} exceptions in the server log"),
)


def verdict(r: dict[str, Any]) -> list[str]:
    failures = [text.format(r[key]) for key, text in CHECKS if r.get(key)]
    if not r.get("shutdown", {}).get("clean"):
        failures.append(f"unclean shutdown: {r.get('shutdown')}")
    failed_deletes = {k: n for k, n in r.get("storm_chat_deletes", {}).items() if k != "204"}
    if failed_deletes:
        failures.append(f"DELETE of storm chats failed: {failed_deletes}")
    if r.get("recovery_s") is None:
        failures.append("/healthz did not report ok after the faults")
    return failures + [r[key] for key in ("stalled", "error") if r.get(key)]


def soak(args) -> dict[str, Any]:
    t = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="pensieve-soak-"))
    _cleanups.append(lambda: shutil.rmtree(tmp, ignore_errors=True))
    log_path = Path(args.server_log) if args.server_log else tmp / "server.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.unlink(missing_ok=True)
    result: dict[str, Any] = {}
    pg, redis = PostgresServer(), RedisServer()
    _cleanups.append(pg.destroy)
    pg.init()
    _cleanups.append(redis.kill)
    redis.start()
    server = Server(
        pg.url,
        log_path,
        # One owner drives all the chats here: the per-owner turn quota (tested on its own)
        # would turn the soak into a test of the quota.
        env={"PENSIEVE_TURNS_PER_MINUTE": "1000000"},
        args=["--redis-url", redis.url, "--device", args.device,
              "--gpu-cache-chunks", str(args.gpu_chunks), "--cpu-cache-chunks", str(args.cpu_chunks)],
    )  # fmt: skip
    _cleanups.append(server.kill)
    token = server.user("soak")
    server.start(timeout=300, healthy=True)
    result["startup_s"] = round(time.monotonic() - t, 1)
    try:
        asyncio.run(drive(args, server, pg, redis, token, result))
    except Exception as e:  # reported with what was measured up to here
        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        if server.proc.poll() is None:  # the run ended before its own shutdown step
            result.setdefault("shutdown", terminate(server))
    if "tally" in result:
        result.update(tally_json(result.pop("tally")))
    result.update(scan_log(log_path.read_text(errors="replace")))
    if result["patterns"]["Application shutdown failed"]:
        result["shutdown"]["clean"] = False
    result["wall_s"] = round(time.monotonic() - t, 1)
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    from bench.lib.plots import plt, save_fig

    fig, ax = plt.subplots(figsize=(8, 4))
    done = result.get("timeline", {}).get("done_s", [])
    failed = result.get("timeline", {}).get("failed_s", [])
    ax.step(done, range(1, len(done) + 1), where="post", label="turns completed")
    ax.step(failed, range(1, len(failed) + 1), where="post", color="tab:red",
            label="turns without a reply")  # fmt: skip
    colours = {"redis": "tab:orange", "postgres-fast": "tab:purple",
               "postgres-immediate": "tab:brown", "postgres-freeze": "tab:gray"}  # fmt: skip
    for w in result.get("fault_windows", []):
        ax.axvspan(w["start_s"], w.get("end_s", w["start_s"]), alpha=0.25,
                   color=colours.get(w["fault"], "gray"), label=f"{w['fault']} down")  # fmt: skip
    for i, w in enumerate(result.get("storm_windows", [])):
        ax.axvspan(w["start_s"], max(w["end_s"], w["start_s"] + 1), alpha=0.15, color="tab:green",
                   label=None if i else "connect/abort storm")  # fmt: skip
    if "final_phase_start_s" in result:
        ax.axvline(result["final_phase_start_s"], color="k", ls="--", lw=1, label="final turns")
    ax.set_xlabel("seconds")
    ax.set_ylabel("turns")
    ax.set_title(
        f"soak: {result.get('conversations', 0)} chats, {result.get('storm_connects', 0)} storm "
        f"connects, {result.get('asgi_exceptions', 0)} exceptions, "
        f"{result.get('lost_messages', 0)} lost"
    )
    ax.legend(loc="upper left", fontsize=8)
    save_fig(fig, path)


def summary(result: dict[str, Any]) -> str:
    keys = ("conversations", "turns_ok", "final_turns_ok", "unusable_chats", "unusable_reasons",
            "error_frames", "turn_failures", "hung_turns", "turn_seconds", "healthz",
            "storm_connects", "aborts", "storm_connect_failures", "storm_windows", "fault_windows", "fault_errors",
            "recovery_s", "storm_chat_deletes", "lost_messages", "mismatched_messages",
            "inconsistent_chats", "asgi_exceptions", "patterns", "exceptions", "shutdown",
            "error", "wall_s")  # fmt: skip
    lines = [f"{k:>22}: {json.dumps(result[k])}" for k in keys if k in result]
    failures = result["verdict"]["failures"]
    lines.append("PASSED" if not failures else "FAILED: " + "; ".join(failures))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=200)
    p.add_argument("--duration", type=float, default=240.0, help="main phase, seconds")
    p.add_argument("--turns", type=int, help="stop the chat workers after this many turns")
    p.add_argument("--workers", type=int, default=8, help="concurrent chat clients")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--storm", type=int, default=1000, help="connect/abort operations")
    p.add_argument("--storm-chats", type=int, default=20, help="chats the storm targets")
    p.add_argument("--storm-concurrency", type=int, default=64)
    p.add_argument("--storm-bursts", type=int, default=4, help="bursts, without faults")
    p.add_argument("--faults", default=",".join(DEFAULT_FAULTS),
                   help=f"comma-separated, in order: {', '.join(FAULTS)}")  # fmt: skip
    p.add_argument("--no-faults", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--gpu-chunks", type=int, default=64, help="small: chats swap and drop")
    p.add_argument("--cpu-chunks", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-log", help="keep the server's log here")
    p.add_argument("--out", default=str(ROOT / "bench/results/soak_cpu.json"))
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    args.faults = [f for f in args.faults.split(",") if f]
    bad = [f for f in args.faults if f not in FAULTS]
    if bad:
        p.error(f"unknown faults {bad}; choose from {', '.join(FAULTS)}")
    if args.conversations < 1 or args.workers < 1 or args.duration <= 0:
        p.error("--conversations, --workers and --duration must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the finally blocks and atexit stop what we started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        result = soak(args)
    except ServiceError as e:
        print(f"soak: {e}", file=sys.stderr)
        return 2
    finally:
        _cleanup_all()
    result["verdict"] = {"passed": not verdict(result), "failures": verdict(result)}
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "server_log")}
    report = {"benchmark": "soak", "environment": environment(), "settings": settings, **result}
    out = write_json(Path(args.out), report)
    if not args.no_plot:
        plot(report, out.with_suffix(".png"))
    print(summary(report))
    print(f"wrote {out}")
    return 0 if report["verdict"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
