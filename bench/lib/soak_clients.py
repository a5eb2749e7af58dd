"""The soak's clients (bench/soak.py): chat turns over the WebSocket, the connect/abort storm
and the /healthz probe, and the tally of what they saw."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import struct
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import websockets
from websockets.exceptions import ConnectionClosed, InvalidStatus

STORM_KINDS = ("idle", "handshake", "mid_turn", "during_close", "reset", "replace")
# Client-side bounds: a server that does not answer within these is reported as hung.
CONNECT_S = 15.0
FRAME_S = 45.0  # the longest wait for any one frame of a turn
TURN_S = 90.0
HTTP_S = 15.0


# --- what the clients saw ---------------------------------------------------------------------


@dataclass
class Tally:
    t0: float = field(default_factory=time.monotonic)
    turns_ok: int = 0
    done_times: list[float] = field(default_factory=list)  # seconds after t0
    fail_times: list[float] = field(default_factory=list)
    error_frames: Counter = field(default_factory=Counter)  # error code -> count
    failures: Counter = field(default_factory=Counter)  # turns without done, by reason
    seen: dict[str, dict[int, str]] = field(default_factory=dict)  # chat -> message id -> text
    storm_connects: int = 0
    storm_connect_failures: Counter = field(default_factory=Counter)
    aborts: Counter = field(default_factory=Counter)
    fault_windows: list[dict[str, Any]] = field(default_factory=list)
    storm_windows: list[dict[str, Any]] = field(default_factory=list)
    fault_errors: list[str] = field(default_factory=list)
    turn_seconds: list[float] = field(default_factory=list)  # every turn that got an answer
    health: list[tuple[float, str, float]] = field(default_factory=list)  # (t, status, seconds)

    def now(self) -> float:
        return time.monotonic() - self.t0


def tally_json(tally: Tally) -> dict[str, Any]:
    answered = sorted(tally.turn_seconds)
    health_s = [s for _, _, s in tally.health]
    return dict(
        turn_seconds={
            "p50": round(answered[len(answered) // 2], 2) if answered else None,
            "max": round(answered[-1], 2) if answered else None,
            "over_10s": sum(s > 10 for s in answered),
        },
        healthz={
            "probes": len(tally.health),
            "status": dict(Counter(status for _, status, _ in tally.health)),
            "max_s": max(health_s, default=None),
            "over_5s": sum(s > 5 for s in health_s),
        },
        error_frames=dict(tally.error_frames),
        turn_failures=dict(tally.failures),
        hung_turns=tally.failures["timeout"] + tally.failures["connect_timeout"],
        storm_connects=tally.storm_connects,
        storm_connect_failures=dict(tally.storm_connect_failures),
        aborts=dict(tally.aborts),
        storm_windows=tally.storm_windows,
        fault_windows=tally.fault_windows,
        fault_errors=tally.fault_errors,
        timeline={
            "done_s": [round(t, 2) for t in tally.done_times],
            "failed_s": [round(t, 2) for t in tally.fail_times],
        },
    )


def closed_reason(e: ConnectionClosed) -> str:
    frame = e.rcvd or e.sent
    return f"closed_{frame.code}" if frame is not None else "closed_1006"


async def connect(base: str, cid: str, token: str):
    url = base.replace("http://", "ws://") + f"/ws/chat/{cid}"
    return await asyncio.wait_for(
        websockets.connect(
            url,
            additional_headers={"Authorization": f"Bearer {token}"},
            open_timeout=CONNECT_S,
            close_timeout=2,
            max_size=2**22,
        ),
        CONNECT_S + 1,
    )


async def one_turn(ws, cid: str, n: int, tally: Tally, max_tokens: int) -> str:
    """Send one message and read frames up to `done` or an error; returns "ok" or a reason."""
    frame_out = {"type": "message", "content": f"Name one colour, please ({n}).",
                 "max_tokens": max_tokens, "temperature": 0}  # fmt: skip
    pieces: list[str] = []
    deadline = time.monotonic() + TURN_S
    try:
        await asyncio.wait_for(ws.send(json.dumps(frame_out)), FRAME_S)
        while True:
            left = min(FRAME_S, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError
            frame = json.loads(await asyncio.wait_for(ws.recv(), left))
            if frame.get("type") in ("done", "error"):
                tally.turn_seconds.append(TURN_S - (deadline - time.monotonic()))
            if frame.get("type") == "token":
                pieces.append(frame["text"])
            elif frame.get("type") == "done":
                tally.turns_ok += 1
                tally.done_times.append(tally.now())
                tally.seen.setdefault(cid, {})[frame["message_id"]] = "".join(pieces)
                return "ok"
            elif frame.get("type") == "error":
                code = str(frame.get("code"))
                tally.error_frames[code] += 1
                return f"error_{code}"
    except TimeoutError:
        return "timeout"
    except ConnectionClosed as e:
        return closed_reason(e)
    except OSError as e:
        return f"os_{type(e).__name__}"


async def visit(base: str, cid: str, token: str, turns: int, n: int, tally: Tally, mt: int) -> str:
    """Connect to one chat and hold `turns` turns; returns the last outcome."""
    try:
        ws = await connect(base, cid, token)
    except TimeoutError:
        reason = "connect_timeout"
    except InvalidStatus as e:
        reason = f"connect_http_{e.response.status_code}"
    except (OSError, websockets.InvalidHandshake) as e:
        reason = f"connect_{type(e).__name__}"
    else:
        try:
            reason = "ok"
            for k in range(turns):
                reason = await one_turn(ws, cid, n + k, tally, mt)
                if reason != "ok":
                    break
        finally:
            await close_quietly(ws)
    if reason != "ok":
        tally.failures[reason] += 1
        tally.fail_times.append(tally.now())
    return reason


async def close_quietly(ws) -> None:
    try:
        await asyncio.wait_for(ws.close(), 5)
    except (TimeoutError, ConnectionClosed, OSError):
        pass
    finally:
        ws.transport.abort()


# --- the drivers ------------------------------------------------------------------------------


async def chat_workers(base, token, chats, tally, stop_at, args) -> None:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for cid in chats:
        queue.put_nowait(cid)
    counter = iter(range(10**9))
    rng = random.Random(args.seed)

    async def worker() -> None:
        while tally.now() < stop_at and (args.turns is None or tally.turns_ok < args.turns):
            cid = await queue.get()
            try:
                outcome = await visit(
                    base, cid, token, rng.choice((1, 2)), next(counter), tally, args.max_tokens
                )
            finally:
                queue.put_nowait(cid)
            # Back off after a failure, as a client would, so an outage is not a busy loop.
            await asyncio.sleep(0.05 if outcome == "ok" else 0.5)

    await asyncio.gather(*(worker() for _ in range(args.workers)))


async def storm_op(base: str, cid: str, token: str, kind: str, rng: random.Random, tally: Tally):
    """One connect/abort; kinds in STORM_KINDS say when and how the line is dropped."""
    if kind == "handshake":  # give up part-way through the opening handshake
        tally.storm_connects += 1
        with contextlib.suppress(TimeoutError, OSError, websockets.InvalidHandshake):
            ws = await asyncio.wait_for(connect(base, cid, token), rng.uniform(0.001, 0.03))
            ws.transport.abort()
        tally.aborts[kind] += 1
        return
    ws = await storm_connect(base, cid, token, tally)
    if ws is None:
        return
    message = json.dumps({"type": "message", "content": "Count to three.", "max_tokens": 8})
    try:
        if kind != "idle" and rng.random() < 0.8:
            await asyncio.wait_for(ws.send(message), 5)
        await asyncio.sleep(rng.uniform(0, 1.2 if kind == "mid_turn" else 0.3))
        if kind == "during_close":  # start the close handshake, drop the line before its end
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ws.close(), rng.uniform(0.0, 0.02))
        elif kind in ("reset", "replace"):  # SO_LINGER 0: the close sends RST instead of FIN
            reset(ws)
    except (ConnectionClosed, OSError):
        pass
    finally:
        ws.transport.abort()
        tally.aborts[kind] += 1
    if kind == "replace":  # a new socket arrives while the server may not yet know of the reset
        ws = await storm_connect(base, cid, token, tally)
        if ws is not None:
            with contextlib.suppress(ConnectionClosed, OSError, TimeoutError):
                await asyncio.wait_for(ws.send(message), 5)
                await asyncio.sleep(rng.uniform(0, 0.3))
            ws.transport.abort()


def reset(ws) -> None:
    sock = ws.transport.get_extra_info("socket")
    with contextlib.suppress(OSError):  # already closed by the server: nothing to reset
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def storm_connect(base: str, cid: str, token: str, tally: Tally):
    try:
        ws = await connect(base, cid, token)
    except InvalidStatus as e:
        tally.storm_connect_failures[f"http_{e.response.status_code}"] += 1
        return None
    except (TimeoutError, OSError, websockets.InvalidHandshake) as e:
        tally.storm_connect_failures[type(e).__name__] += 1
        return None
    tally.storm_connects += 1
    return ws


def storm_times(schedule: list[tuple[str, float, float]], duration: float, bursts: int):
    """Burst start times: at 5% of the run, and just after each fault (recovery is when
    sockets of the outage are still being torn down); without faults, evenly spread."""
    if schedule:
        return [0.05 * duration] + [end + 0.02 * duration for _, _, end in schedule]
    return [0.05 * duration + i * 0.85 * duration / bursts for i in range(bursts)]


async def storm(base, token, targets, tally, times, args) -> None:
    """`args.storm` connect/abort operations in bursts at `times`, `args.storm_concurrency` at
    a time, on a few chats (few chats: replacements race with closes)."""
    if args.storm <= 0 or not times:
        return
    rng = random.Random(args.seed + 1)
    gate = asyncio.Semaphore(args.storm_concurrency)

    async def op(kind: str, cid: str) -> None:
        try:
            await asyncio.wait_for(storm_op(base, cid, token, kind, rng, tally), 2 * CONNECT_S + 10)
        except TimeoutError:
            tally.storm_connect_failures["timeout"] += 1
        finally:
            gate.release()

    sizes = [args.storm // len(times) + (i < args.storm % len(times)) for i in range(len(times))]
    for at, size in zip(times, sizes, strict=True):
        await asyncio.sleep(max(0.0, at - tally.now()))
        window = {"start_s": round(tally.now(), 2), "ops": size}
        tasks = []
        for _ in range(size):
            await gate.acquire()
            tasks.append(asyncio.create_task(op(rng.choice(STORM_KINDS), rng.choice(targets))))
        await asyncio.gather(*tasks)
        window["end_s"] = round(tally.now(), 2)
        tally.storm_windows.append(window)


async def health_probe(http: httpx.AsyncClient, tally: Tally, stop_at: float) -> None:
    """/healthz once a second: how long it takes to answer, outage or not."""
    while tally.now() < stop_at:
        t = time.monotonic()
        try:
            status = str((await http.get("/healthz", timeout=HTTP_S)).status_code)
        except httpx.TimeoutException:
            status = "timeout"
        except httpx.HTTPError as e:
            status = type(e).__name__
        tally.health.append((round(tally.now(), 2), status, round(time.monotonic() - t, 3)))
        await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - t)))
