"""Load test of a cluster: `pensieve cluster` (3 replicas behind HAProxy) on its own
PostgreSQL and Redis, 60 concurrent chats of 3 turns through the front, and one replica
SIGKILLed in the middle.

    python -m bench.cluster                       # 60 chats x 3 turns, 3 replicas, one killed
    python -m bench.cluster --chats 12 --no-kill  # a quick look

A chat whose socket drops reconnects through the front and resends its turn; the launcher
restarts the killed replica. At the end every answered turn must be stored in its chat with
the streamed text under a message id no other chat has. Reported: throughput, the share of
turns that recomputed context, and what the killed replica's chats went through. JSON and
PNG in bench/results/; exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import websockets
from websockets.exceptions import ConnectionClosed, InvalidStatus

from bench.lib.common import RESULTS, environment, write_json
from bench.lib.harness import LocalCluster, PostgresServer, RedisServer

RECONNECT_S = 120.0  # a chat gives up on a turn after this long without an answer


@dataclass
class TurnLog:
    chat: int
    turn: int
    sent_at: float  # seconds after the start
    done_at: float
    ttft_ms: float
    usage: dict
    message_id: int
    text: str
    attempts: int  # 1, or more when the socket dropped and the turn was sent again


@dataclass
class Chat:
    index: int
    cid: str = ""
    turns: list[TurnLog] = field(default_factory=list)
    drops: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass
class Run:
    front: str
    token: str
    cluster: LocalCluster  # its admin listing of the replicas
    t0: float = field(default_factory=time.monotonic)
    done: int = 0
    killed: dict | None = None

    def now(self) -> float:
        return time.monotonic() - self.t0


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def listing(run: Run) -> dict:
    return await asyncio.to_thread(run.cluster.listing)


async def one_turn(ws, content: str, max_tokens: int) -> tuple[dict, str]:
    await ws.send(json.dumps({"type": "message", "content": content, "max_tokens": max_tokens}))
    pieces = []
    while True:
        frame = json.loads(await asyncio.wait_for(ws.recv(), RECONNECT_S))
        if frame["type"] == "token":
            pieces.append(frame["text"])
        elif frame["type"] == "done":
            return frame, "".join(pieces)
        elif frame["type"] == "error":
            raise RuntimeError(f"{frame['code']}: {frame['message']}")


async def drive_chat(run: Run, chat: Chat, turns: int, max_tokens: int, think: float) -> None:
    async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
        r = await c.post(run.front + "/api/conversations", json={}, headers=auth(run.token))
        r.raise_for_status()
        chat.cid = r.json()["id"]
    url = run.front.replace("http://", "ws://") + "/ws/chat/" + chat.cid
    rng = random.Random(chat.index)
    turn, attempts, ws = 0, 0, None
    deadline = time.monotonic() + RECONNECT_S
    while turn < turns:
        if time.monotonic() > deadline:
            chat.errors.append(f"turn {turn}: no answer within {RECONNECT_S:.0f} s")
            break
        try:
            if ws is None:
                ws = await websockets.connect(url, additional_headers=auth(run.token), proxy=None)
            content = (
                f"Chat {chat.index}, turn {turn}: tell me about the number {chat.index * 7 + turn}."
            )
            attempts += 1
            sent = run.now()
            done, text = await one_turn(ws, content, max_tokens)
        except (ConnectionClosed, OSError, InvalidStatus, TimeoutError) as e:
            chat.drops += 1
            chat.errors.append(f"turn {turn}: {type(e).__name__}, reconnecting")
            ws = None
            await asyncio.sleep(0.5)
            continue
        except RuntimeError as e:  # an error frame: busy, conflict... send again shortly
            chat.errors.append(f"turn {turn}: {e}")
            await asyncio.sleep(1.0)
            continue
        chat.turns.append(
            TurnLog(chat.index, turn, sent, run.now(), done["timing"]["ttft_ms"], done["usage"],
                    done["message_id"], text, attempts)
        )  # fmt: skip
        run.done += 1
        turn, attempts = turn + 1, 0
        deadline = time.monotonic() + RECONNECT_S
        if turn < turns:
            await asyncio.sleep(think * rng.uniform(0.5, 1.5))
    if ws is not None:
        await ws.close()


async def killer(run: Run, at_turns: int, total: int) -> None:
    """SIGKILL the replica holding the most chats once `at_turns` turns are answered."""
    while run.done < at_turns:
        await asyncio.sleep(0.1)
    replicas = [r for r in (await listing(run))["replicas"] if r["alive"]]
    victim = max(replicas, key=lambda r: r.get("conversations", 0))
    held = [c["id"] for c in victim.get("held", [])]
    os.kill(victim["pid"], signal.SIGKILL)
    run.killed = {"replica": victim["id"], "pid": victim["pid"], "at_s": round(run.now(), 2),
                  "after_turns": run.done, "held": held}  # fmt: skip
    print(f"killed {victim['id']} (pid {victim['pid']}) holding {len(held)} chats "
          f"after {run.done}/{total} turns", flush=True)  # fmt: skip
    while True:  # the launcher restarts it: when does it rejoin?
        await asyncio.sleep(0.5)
        try:
            back = {r["id"]: r for r in (await listing(run))["replicas"]}.get(victim["id"])
        except httpx.HTTPError:
            continue
        if back and back["alive"] and back["pid"] != victim["pid"]:
            run.killed["rejoined_at_s"] = round(run.now(), 2)
            return


async def check(run: Run, chats: list[Chat], turns: int) -> dict[str, Any]:
    """Everything the clients saw answered is stored in the right chat."""
    problems: list[str] = []
    ids: dict[int, int] = {}
    async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
        for chat in chats:
            if len(chat.turns) != turns:
                problems.append(f"chat {chat.index}: {len(chat.turns)}/{turns} turns answered")
            if not chat.cid:
                continue
            r = await c.get(f"{run.front}/api/conversations/{chat.cid}", headers=auth(run.token))
            stored = {m["id"]: m for m in r.json()["messages"]}
            users = [m["content"] for m in r.json()["messages"] if m["role"] == "user"]
            for t in chat.turns:
                m = stored.get(t.message_id)
                if m is None or m["role"] != "assistant" or m["content"] != t.text:
                    problems.append(f"chat {chat.index} turn {t.turn}: reply not stored as seen")
                if ids.setdefault(t.message_id, chat.index) != chat.index:
                    problems.append(f"message {t.message_id} answered two chats")
            if any(not u.startswith(f"Chat {chat.index},") for u in users):
                problems.append(f"chat {chat.index}: holds another chat's message")
    return {"ok": not problems, "problems": problems[:50]}


def plot(result: dict[str, Any], path: Path) -> None:
    from bench.lib.plots import plt, save_fig

    turns = result["turns"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    done = sorted(t["done_at"] for t in turns)
    a.step(done, range(1, len(done) + 1), where="post", color="tab:blue")
    a.set_xlabel("seconds")
    a.set_ylabel("turns answered")
    a.set_title(f"{result['chats']} chats x {result['turns_per_chat']} turns, "
                f"{result['replicas']} replicas")  # fmt: skip
    for ax in (a, b):
        if result.get("killed"):
            ax.axvline(result["killed"]["at_s"], color="tab:red", ls="--", label="replica killed")
            if "rejoined_at_s" in result["killed"]:
                ax.axvline(result["killed"]["rejoined_at_s"], color="tab:green", ls=":",
                           label="replica rejoined")  # fmt: skip
    kinds = {"cached": ("tab:blue", "o"), "recomputed": ("tab:red", "x"), "new": ("0.6", ".")}
    for kind, (color, marker) in kinds.items():
        xs = [t["done_at"] for t in turns if t["kind"] == kind]
        ys = [t["ttft_ms"] for t in turns if t["kind"] == kind]
        b.scatter(xs, ys, s=14, color=color, marker=marker, label=f"{kind} ({len(xs)})")
    b.set_xlabel("seconds")
    b.set_ylabel("TTFT (ms)")
    b.set_title("time to first token, by how the context was found")
    b.legend(fontsize=8)
    a.legend(fontsize=8)
    fig.suptitle(f"{result['environment']['device']} · {result['environment']['git_commit'][:12]}",
                 fontsize=8)  # fmt: skip
    save_fig(fig, path)


def kind_of(t: TurnLog) -> str:
    if t.usage["recomputed_tokens"] > 0:
        return "recomputed"
    if t.turn == 0:
        return "new"
    return "cached"


def summarize(args, run: Run, chats: list[Chat], wall: float, verdict: dict) -> dict[str, Any]:
    turns = [t for c in chats for t in c.turns]
    later = [t for t in turns if t.turn > 0]
    killed_held = set(run.killed["held"]) if run.killed else set()
    affected = [c for c in chats if c.cid in killed_held]
    after_kill = [t for c in affected for t in c.turns
                  if run.killed and t.sent_at >= run.killed["at_s"] - 1]  # fmt: skip
    completion = sum(t.usage["completion_tokens"] for t in turns)
    return {
        "benchmark": "cluster",
        "model": args.model,
        "replicas": args.replicas,
        "chats": args.chats,
        "turns_per_chat": args.turns,
        "max_tokens": args.max_tokens,
        "think_s": args.think,
        "pools": {"gpu_chunks": args.gpu_chunks, "cpu_chunks": args.cpu_chunks},
        "wall_s": round(wall, 2),
        "turns_answered": len(turns),
        "turns_per_s": round(len(turns) / wall, 3),
        "completion_tokens_per_s": round(completion / wall, 2),
        "ttft_ms_median": sorted(t.ttft_ms for t in turns)[len(turns) // 2] if turns else None,
        "share_recomputed": round(
            sum(kind_of(t) == "recomputed" for t in later) / max(1, len(later)), 4
        ),
        "share_cached": round(sum(kind_of(t) == "cached" for t in later) / max(1, len(later)), 4),
        "turns_resent": sum(t.attempts > 1 for t in turns),
        "socket_drops": sum(c.drops for c in chats),
        "killed": run.killed,
        "affected_chats": len(affected),
        "affected_chats_finished": sum(len(c.turns) == args.turns for c in affected),
        "affected_turns_after_kill_recomputed": sum(kind_of(t) == "recomputed" for t in after_kill),
        "affected_turns_after_kill": len(after_kill),
        "check": verdict,
        "environment": environment(args.device),
        "turns": [{**t.__dict__, "kind": kind_of(t), "text": None} for t in turns],
        "chat_errors": {c.index: c.errors for c in chats if c.errors},
    }


async def drive(args, run: Run) -> dict[str, Any]:
    chats = [Chat(i) for i in range(args.chats)]
    total = args.chats * args.turns
    tasks = [asyncio.create_task(drive_chat(run, c, args.turns, args.max_tokens, args.think))
             for c in chats]  # fmt: skip
    kill = asyncio.create_task(killer(run, total // 2, total)) if args.kill else None
    t0 = time.monotonic()
    await asyncio.gather(*tasks)
    wall = time.monotonic() - t0
    if kill is not None:
        try:
            await asyncio.wait_for(kill, 300)
        except TimeoutError:
            print("the killed replica did not rejoin within 300 s", flush=True)
    verdict = await check(run, chats, args.turns)
    return summarize(args, run, chats, wall, verdict)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--chats", type=int, default=60)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--think", type=float, default=2.0, help="mean seconds between turns")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", default="cpu")
    p.add_argument("--gpu-chunks", type=int, default=64)
    p.add_argument("--cpu-chunks", type=int, default=128)
    p.add_argument("--kill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--out", default=None, help="result name (default cluster_<device>)")
    p.add_argument("--out-dir", type=Path, default=RESULTS, help="where the JSON and PNG go")
    args = p.parse_args(argv)
    name = args.out or f"cluster_{args.device}"
    pg, redis = PostgresServer(), RedisServer()
    log = Path(tempfile.gettempdir()) / f"pensieve-{name}.log"  # the replicas' and HAProxy's
    cluster = LocalCluster(
        pg.url,
        log,
        env={"PENSIEVE_TURNS_PER_MINUTE": "1000000"},
        args=["--redis-url", redis.url, "--model", args.model, "--device", args.device,
              "--gpu-cache-chunks", str(args.gpu_chunks),
              "--cpu-cache-chunks", str(args.cpu_chunks)],
        replicas=args.replicas,
    )  # fmt: skip
    try:
        pg.init()
        redis.start()
        token = cluster.user("load")
        cluster.start(timeout=600)
        print(f"cluster up at {cluster.url}", flush=True)
        result = asyncio.run(drive(args, Run(cluster.url, token, cluster)))
    finally:
        cluster.stop(60)
        redis.kill()
        pg.destroy()
    write_json(args.out_dir / f"{name}.json", result)
    plot(result, args.out_dir / f"{name}.png")
    keys = ("wall_s", "turns_answered", "turns_per_s", "completion_tokens_per_s",
            "share_recomputed", "share_cached", "turns_resent", "affected_chats",
            "affected_chats_finished", "affected_turns_after_kill_recomputed")  # fmt: skip
    print(json.dumps({k: result[k] for k in keys} | {"check": result["check"]}, indent=1))
    return 0 if result["check"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
