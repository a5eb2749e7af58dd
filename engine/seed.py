"""A seeded engine: conversations placed in the tiers as a given state says, without
running their turns, so that a measurement starts in a steady state instead of an empty
cache (`bench/lib/steady.py` seeds a real engine and its simulated twin from one state).

Each `Seed` is a conversation's token stream, the tier of each chunk of its computed
positions and its last activity. The chunks get their blocks through the cache's own
accounting (`KVCacheManager.place`), so `check()` holds and eviction, swaps and
admission treat them as any other; the stream record is what a turn's end leaves, so the
conversation's next turn sends only its new tokens: a stateless engine recomputes the
whole history, pensieve finds its GPU chunks cached, swaps its CPU chunks in and
recomputes its dropped leading chunks from the history.

**For measurement only.** The blocks of a chunk placed on the GPU or the CPU tier (or in
the disk tier's files) hold whatever they held: its KV is not computed, so with real
weights the replies that attend to it are not the model's. A seed whose chunks are all
dropped is exact: every position is recomputed from the history, as after a restart.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.cache.chunks import DISK
from engine.cache.sharing import chain_hashes
from engine.stream import StreamState

if TYPE_CHECKING:
    from engine.conversations import Conversations
    from engine.kv_pool import KVPool


@dataclass
class Seed:
    conversation_id: str
    tokens: list[int]  # its stream so far: every prompt and reply, in order
    # The tier of each chunk of its first `computed` positions, of "gpu", "cpu", "both" (a
    # GPU block with a CPU copy), "disk" (dropped, in the disk tier's files), "dropped";
    # laid out [dropped or disk | cpu | gpu or both]
    residency: Sequence[str]
    last_active: float  # on the engine's clock (`Engine.now`)
    # Positions whose KV the chunks stand for (None: every token). A turn that ends leaves
    # its last sampled token uncomputed (len(tokens) - 1); the next turn computes it first.
    computed: int | None = None

    @property
    def kv_len(self) -> int:
        return len(self.tokens) if self.computed is None else self.computed


def plant(conv: Conversations, pool: KVPool, seeds: Iterable[Seed]) -> None:
    """Place every seed (the engine's lock held, no turn in flight), all or none:
    ValueError, with nothing changed, for a conversation held already, for a residency the
    cache's mode cannot hold (`KVCacheManager.blocks_to_place`), or for more blocks than its
    tiers have free."""
    seeds = list(seeds)
    cache = conv.cache
    ids = [s.conversation_id for s in seeds]
    if len(set(ids)) != len(ids):
        raise ValueError("a conversation is seeded twice")
    gpu = cpu = 0
    for s in seeds:
        cid = s.conversation_id
        if cid in conv.claims:
            raise ValueError(f"conversation {cid!r} has a turn in flight")
        if cid in conv.streams or cache.find(cid) is not None:
            raise ValueError(f"conversation {cid!r} is held already: free it first")
        if not 0 <= s.kv_len <= len(s.tokens):
            raise ValueError(f"{cid!r}: {s.kv_len} computed positions of {len(s.tokens)}")
        if len(s.tokens) >= conv.max_context:
            raise ValueError(f"{cid!r}: {len(s.tokens)} tokens reach the model's limit")
        try:
            g, c = cache.blocks_to_place(s.residency, s.kv_len)
        except ValueError as e:
            raise ValueError(f"{cid!r}: {e}") from None
        gpu, cpu = gpu + g, cpu + c
    free_gpu, free_cpu = cache.usage("gpu")[2], cache.usage("cpu")[2]
    if gpu > free_gpu or cpu > free_cpu:
        raise ValueError(
            f"the seeds take {gpu} GPU and {cpu} CPU blocks; {free_gpu} and {free_cpu} are free"
        )
    cs = cache.chunk_size
    parts = None  # what a disk tier's seeded files hold: any block's bytes
    for s in seeds:
        cid, tokens = s.conversation_id, list(s.tokens)
        cache.place(cache.table(cid), s.residency, s.kv_len)
        full = len(tokens) // cs * cs
        conv.streams[cid] = StreamState(
            cid,
            length=len(tokens),
            kv_len=s.kv_len,
            tail=tokens[s.kv_len :],
            idle_since=s.last_active,
            hashes=chain_hashes(tokens[:full], cs),
            unhashed=tokens[full:],
        )
        if conv.owns_history:  # else the caller's history must hold these tokens
            conv.history.forget(cid)
            conv.history.append(cid, tokens)
        conv.clock.touch(cid, s.last_active)
        for i, tier in enumerate(s.residency):
            if tier == DISK:
                if parts is None:
                    pages = tuple(range(pool.layout.groups))  # any pages' bytes, every group's
                    parts = pool.read_pages("cpu" if pool.cpu_blocks else "gpu", pages)
                conv.disk.seed(conv.streams[cid].hashes[i], i, parts, pool.bytes_per_chunk)
