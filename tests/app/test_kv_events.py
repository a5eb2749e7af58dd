"""KV events read by NVIDIA Dynamo's own KV indexer (`python -m dynamo.indexer`), subscribed to
two real servers: it finds each conversation on the server that served it and not on the
other, follows its chunks from the GPU to the CPU under memory pressure, and forgets a server
that restarts until its conversations come back; a late subscriber catches up through the
replay socket; a bad endpoint is refused at start, naming its flag."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq

from bench.lib.harness import ServiceError, free_port
from tests.app.openai.test_app_openai import ask, client
from tests.app_fixtures import TINY, Server, wait_for
from tests.services import wait_port

WORDS = ["river", "stone", "cloud", "lantern", "meadow", "copper", "violin", "harbor"]


def story(i: int, n: int = 150) -> str:
    """A long, distinct first message: several full chunks."""
    return f"Story {i}: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n))


class Indexer:
    def __init__(self, workers: dict[int, str], log: Path) -> None:
        self.port = free_port()
        spec = ",".join(f"{w}={url}" for w, url in workers.items())
        cmd = [sys.executable, "-m", "dynamo.indexer", "--block-size", "32", "--threads", "1"]
        cmd += ["--port", str(self.port), "--workers", spec]
        self.proc = subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT)
        wait_port("127.0.0.1", self.port, timeout=30)

    def match(self, tokens: list[int]) -> dict[int, dict[str, int]]:
        """Per worker: the tokens matched on the GPU, and on the CPU or disk at most."""
        r = httpx.post(
            f"http://127.0.0.1:{self.port}/query",
            json={"token_ids": tokens, "model_name": "default"},
        )
        assert r.status_code == 200, r.text
        return {int(w): m for w, m in r.json()["instances"].items()}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def events_env(pub: int, replay: int) -> dict[str, str]:
    return {
        **TINY,
        "PENSIEVE_TURNS_PER_MINUTE": "1000",
        "PENSIEVE_KV_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{pub}",
        "PENSIEVE_KV_EVENTS_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{replay}",
    }


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kv-events")
    ports = [(free_port(), free_port()) for _ in range(2)]
    servers = [
        Server(f"sqlite+aiosqlite:///{tmp}/s{i}.db", tmp / f"s{i}.log", env=events_env(*p))
        for i, p in enumerate(ports)
    ]
    for s in servers:
        s.start()
    indexer = Indexer({i + 1: f"tcp://127.0.0.1:{p}" for i, (p, _) in enumerate(ports)}, tmp / "ix")
    yield servers, indexer, ports
    indexer.stop()
    for s in servers:
        s.stop()
        assert "Traceback" not in s.log_tail(100_000)


def prompt_tokens(srv: Server, key: str, messages: list[dict]) -> list[int]:
    r = httpx.post(srv.url + "/tokenize", json={"messages": messages}, headers=auth_of(key))
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def auth_of(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_the_indexer_finds_each_conversation_where_it_lives(fleet):
    servers, indexer, ports = fleet
    keys = [s.user("alice") for s in servers]
    chats: dict[int, list[tuple[str, list[int]]]] = {0: [], 1: []}
    for i in range(4):
        side = i % 2
        messages = [{"role": "user", "content": story(i)}]
        ask(client(servers[side], keys[side]), messages, extra_headers={"X-Session-ID": f"c{i}"})
        chats[side].append((f"c{i}", prompt_tokens(servers[side], keys[side], messages)))

    def where(tokens: list[int]) -> dict[int, dict[str, int]]:
        return {w: m for w, m in indexer.match(tokens).items() if m["longest_matched"]}

    for side, held in chats.items():
        for cid, tokens in held:
            full = len(tokens) // 32 * 32
            found = wait_for(lambda t=tokens: where(t), timeout=10)
            assert set(found) == {side + 1}, (cid, found)  # on its server, not on the other
            assert found[side + 1]["gpu"] == full, (cid, found)

    # memory pressure on server 0: more chats push c0's chunks to the CPU (or drop its
    # leading ones: then it is served from "storage", the history); it still matches there
    first = chats[0][0][1]
    c = client(servers[0], keys[0])
    for i in range(4, 12, 2):
        ask(c, [{"role": "user", "content": story(i)}], extra_headers={"X-Session-ID": f"c{i}"})
        found = where(first)
        if found.get(1, {}).get("gpu", 1) == 0:
            break
    moved = wait_for(lambda: where(first).get(1, {}).get("gpu") == 0, timeout=10)
    assert moved, where(first)
    found = where(first)
    assert set(found) == {1} and found[1]["disk"] == len(first) // 32 * 32, found

    # a late subscriber asks the replay socket for everything server 0 buffered
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(f"tcp://127.0.0.1:{ports[0][1]}")
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    kinds, seqs = [], []
    while True:
        _, seq, payload = sock.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            break
        seqs.append(int.from_bytes(seq, "big"))
        kinds += [e["type"] for e in msgpack.unpackb(payload)[1]]
    ctx.destroy(linger=0)
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert kinds[0] == "AllBlocksCleared" and {"BlockStored", "BlockRemoved"} <= set(kinds)

    # a restart clears what the indexer knew of server 0; a returning chat announces again
    servers[0].stop()
    servers[0].start()
    assert wait_for(lambda: 1 not in where(first), timeout=15), where(first)
    assert 2 in where(chats[1][0][1])  # the other server is untouched
    ask(
        client(servers[0], keys[0]),
        [{"role": "user", "content": story(0)}],
        extra_headers={"X-Session-ID": "again"},
    )
    assert wait_for(lambda: where(first).get(1, {}).get("gpu"), timeout=10), where(first)


def test_a_bad_endpoint_is_refused_at_start_naming_its_flag(tmp_path):
    taken = free_port()
    ctx = zmq.Context()
    holder = ctx.socket(zmq.PUB)
    holder.bind(f"tcp://127.0.0.1:{taken}")
    try:
        env = events_env(taken, free_port())
        srv = Server(f"sqlite+aiosqlite:///{tmp_path}/x.db", tmp_path / "x.log", env=env)
        with pytest.raises(ServiceError, match="--kv-events-endpoint"):
            srv.start(timeout=120)
    finally:
        ctx.destroy(linger=0)
    env["PENSIEVE_KV_EVENTS_ENDPOINT"] = "http://nope"
    srv = Server(f"sqlite+aiosqlite:///{tmp_path}/y.db", tmp_path / "y.log", env=env)
    with pytest.raises(ServiceError, match="kv_events_endpoint"):
        srv.start(timeout=60)


def test_a_warm_restart_announces_what_its_disk_tier_holds(tmp_path):
    """A graceful stop writes the chats' chunks to the disk tier; the restarted server
    announces them (STORAGE) from the history before any of them returns."""
    pub, replay = free_port(), free_port()
    env = {**events_env(pub, replay), "PENSIEVE_DISK_CACHE_DIR": str(tmp_path / "kv")}
    srv = Server(f"sqlite+aiosqlite:///{tmp_path}/d.db", tmp_path / "d.log", env=env).start()
    indexer = Indexer({1: f"tcp://127.0.0.1:{pub}"}, tmp_path / "ix")
    try:
        key = srv.user("dora")
        messages = [{"role": "user", "content": story(7)}]
        ask(client(srv, key), messages, extra_headers={"X-Session-ID": "disk-1"})
        tokens = prompt_tokens(srv, key, messages)
        full = len(tokens) // 32 * 32
        assert wait_for(lambda: indexer.match(tokens).get(1, {}).get("gpu") == full, 10)
        srv.stop()  # graceful: its chunks are written to the disk tier
        srv.start()
        # the restart's clear, then the disk tier's chunks: on disk, nowhere in memory
        on_disk = {"gpu": 0, "cpu": 0, "disk": full}

        def restored() -> bool:
            m = indexer.match(tokens).get(1, {})
            return {k: m.get(k) for k in on_disk} == on_disk

        assert wait_for(restored, 30), indexer.match(tokens)
    finally:
        indexer.stop()
        srv.stop()
    assert "Traceback" not in srv.log_tail(100_000)
