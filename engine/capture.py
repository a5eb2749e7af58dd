"""The facts of an engine's snapshot, read from its conversations and cache under the
engine's lock in O(1) a conversation (`Held`); `Capture.build()` spells them out without it."""

from __future__ import annotations

from dataclasses import replace

from engine.conversations import Conversations
from engine.snapshot import Capture, EngineSnapshot, Held, PoolUsage, SharingUsage


def capture(
    conv: Conversations,
    counts: tuple[int, int],
    device: str,
    context_limit: int,
    page_bytes: int = 0,
) -> Capture:
    """`counts`: turns running and waiting (`Scheduler.counts`); `page_bytes`: a block's
    bytes (engine/kv_layout.py), for the KV bytes per tier and layer type."""
    now = conv.now()
    c, streams, last_active = conv.cache, conv.streams, conv.clock.last_active
    on_disk = conv.disk.keys() if conv.disk is not None else None  # dropped: "disk"
    held = []
    for t in c.tables.values():
        state = streams.get(t.id)
        d, s, o = t.n_dropped, t.n_shared, t.n_off_gpu
        shared = tuple((x.tier, len(x.holders)) for x in t.chunks[d:s]) if s > d else ()
        disk: tuple[int, ...] = ()
        if on_disk and state is not None:
            hashes = state.hashes
            disk = tuple(j for j in range(min(d, len(hashes))) if hashes[j] in on_disk)
        held.append(
            Held(
                t.id,
                0 if state is None else state.length,
                d,
                shared,
                o - s,
                len(t.chunks) - o,
                disk,
                t.pinned,
                last_active(t.id),
                c.lowest_value(t, now),
                t.gone,
            )  # fmt: skip
        )
    config, (running, waiting) = conv.config, counts
    head = EngineSnapshot(
        device=device,
        model=config.model,
        chunk_size=c.chunk_size,
        cache_mode=config.cache_mode,
        eviction=config.eviction,
        gpu=PoolUsage(*c.usage("gpu")),
        cpu=PoolUsage(*c.usage("cpu")),
        counters=replace(conv.counters, running=running, waiting=waiting),
        conversations=(),
        context_limit=context_limit,
        sharing=SharingUsage(*c.sharing_usage()),
        disk=None if conv.disk is None else conv.disk.usage(),
        pins=conv.retainer.usage(now),
        kv_bytes={
            tier: {"full": full * page_bytes, "sliding": sliding * page_bytes}
            for tier in ("gpu", "cpu")
            for full, sliding in [c.tiers.layer_pages(tier)]
        },
    )
    return Capture(now, head, tuple(held))
