"""The KV events publisher: the engine's events (engine/kv_events.py) on a ZMQ PUB socket in
vLLM's wire format, which NVIDIA Dynamo's KV router and indexer, vLLM's router and llm-d's
scorer read, and a ROUTER socket that replays the recent batches to a late subscriber.

Frames: `[topic, seq (8 bytes, big-endian), payload]`, the payload a msgpack `EventBatch`
`[ts, events, data_parallel_rank]`, each event a map tagged by `type` (`BlockStored`:
`block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name`;
`BlockRemoved`: `block_hashes, medium`; `AllBlocksCleared`): vllm-router reads only maps,
Dynamo both maps and arrays. A replay request `[start_seq]` is answered with every
buffered `[seq, payload]` from it on, then `[-1, b""]`. Sequence numbers start from the
start time in microseconds, so a subscriber sees a restart as a jump forward, never back.

A PUB socket loses what it sends before a subscriber connects, so the socket is an XPUB that
hears each subscription: when one comes (a new router, or one that knew this server before it
restarted), the next batch clears everything and announces all that is held again.

One thread owns the sockets (ZMQ sockets are not thread-safe): it polls the engine's events
every `interval_s` (under the engine's lock, a few microseconds a changed conversation) and
serves subscriptions and replay requests between polls.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable

import msgpack
import zmq

from engine.kv_events import AllCleared, BlockStored, Event

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_BATCHES = 10_000  # batches kept for late subscribers


RESTORE_LIMIT = 10_000  # most recent conversations a restart looks for on the disk tier


async def announce_disk(engine, store, limit: int = RESTORE_LIMIT, batch: int = 64) -> int:
    """A warm restart: announce what the disk tier holds of the most recent conversations
    (their tokens read from the history: the tier's files are keyed by hash alone), so a
    router sends them back here before they return. Returns how many had chunks there."""
    ids = await store.recent_conversation_ids(limit)
    found = 0
    for i in range(0, len(ids), batch):
        histories = [(cid, await store.stream(cid)) for cid in ids[i : i + batch]]
        found += await asyncio.to_thread(engine.announce_disk, histories)
    log.info("KV events: %d of %d conversations announced from the disk tier", found, len(ids))
    return found


class EndpointError(ValueError):
    """A KV events endpoint that cannot be bound; names its flag."""


def encode(e: Event, block_size: int) -> dict:
    if isinstance(e, AllCleared):
        return {"type": "AllBlocksCleared"}
    if isinstance(e, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": e.hashes,
            "parent_block_hash": e.parent,
            "token_ids": e.tokens,
            "block_size": block_size,
            "lora_id": None,
            "medium": e.medium,
            "lora_name": None,
        }
    return {"type": "BlockRemoved", "block_hashes": e.hashes, "medium": e.medium}


class Publisher:
    def __init__(
        self,
        events: Callable[[bool], list[Event]],
        block_size: int,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        interval_s: float = 0.05,
    ) -> None:
        self.events, self.block_size, self.interval_s = events, block_size, interval_s
        self.topic = topic.encode()
        self.ctx = zmq.Context()
        self.pub = self._bind(zmq.XPUB, endpoint, "--kv-events-endpoint")
        self.replay = None
        if replay_endpoint:
            self.replay = self._bind(zmq.ROUTER, replay_endpoint, "--kv-events-replay-endpoint")
        self.seq = time.time_ns() // 1000
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=REPLAY_BATCHES)
        self.published = 0  # events sent
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    def _bind(self, kind: int, endpoint: str, flag: str) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.XPUB:
            sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not the first
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            sock.close()
            self.ctx.term()
            raise EndpointError(f"{flag} {endpoint!r}: cannot bind ({e})") from e
        return sock

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.ctx.destroy(linger=0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.pub, zmq.POLLIN)
        if self.replay is not None:
            poller.register(self.replay, zmq.POLLIN)
        joined = False
        while not self._stop.is_set():
            try:
                self.publish(full=joined)
                joined = False
                for sock, _ in poller.poll(timeout=self.interval_s * 1000):
                    if sock is self.pub:
                        joined |= self.pub.recv()[:1] == b"\x01"  # a subscription
                    else:
                        self._answer_replay()
            except Exception:  # a publisher that dies silently would leave routers stale
                log.exception("KV events: publishing failed; retrying")
                self._stop.wait(1.0)
        self.publish()  # what the last steps did

    def publish(self, full: bool = False) -> int:
        """Send the engine's events since the last call as one batch (`full`: all that is
        held, after clearing); the events sent."""
        events = self.events(full)
        if not events:
            return 0
        payload = msgpack.packb(
            [time.time(), [encode(e, self.block_size) for e in events], 0], use_bin_type=True
        )
        self.seq += 1
        self.pub.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload])
        self.buffer.append((self.seq, payload))
        self.published += len(events)
        return len(events)

    def _answer_replay(self) -> None:
        frames = self.replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: a malformed replay request (%d frames) ignored", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self.buffer):
            if seq >= start_seq:
                self.replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        self.replay.send_multipart([client, b"", END_SEQ, b""])
