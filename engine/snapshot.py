"""What the engine shows of itself: a typed, immutable snapshot of pools, counters and
conversations. `to_dict` gives the JSON shape the admin API serves.

A snapshot is made in two halves. `Engine.capture` reads the facts under the engine's
lock: each conversation's table as counts of its layout [dropped | shared | CPU | GPU]
(`Held`, O(1) a conversation but for a shared run or a disk tier), never a tier per chunk.
`Capture.build` spells them out into the snapshot without the lock, where and when it is
wanted: the async front captures every 0.2 s on its step loop and builds on the event loop
only when a page or a scrape asks (`engine/async_engine.py`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, NamedTuple


@dataclass(frozen=True)
class PoolUsage:
    total: int
    used: int
    free: int


@dataclass
class EngineCounters:
    """Totals since the engine started, and the turns queued and running now. One tally,
    shared: the engine counts prompts, tokens and steps, the cache what moved between the
    tiers, prefetch what it brought back. A snapshot holds a copy, with running and waiting
    filled in (the tally leaves them 0)."""

    swapped_in_tokens: int = 0
    swapped_out_tokens: int = 0
    recomputed_tokens: int = 0
    cached_tokens: int = 0
    dropped_tokens: int = 0
    suspensions: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    shared_tokens: int = 0  # prompt tokens of new conversations found in shared chunks
    prefetched_tokens: int = 0  # context brought back to the GPU ahead of a turn (typing)
    disk_tokens: int = 0  # context read back from the disk tier instead of recomputed
    spilled_tokens: int = 0  # dropped from memory and queued for the disk tier
    # Reply tokens re-encoded as the chat template renders them in history (a thinking
    # reply without its thinking, `Engine.rewrite`): the next turn computes them
    reencoded_tokens: int = 0
    # Chunks copied to the CPU ahead of time (in the background), and what became of them:
    # GPU block reclaimed later with no copy then (the copy spared a synchronous swap-out
    # or a drop), read back by a swap-in (after a reclaim), or the copy given up while the
    # chunk was still on the GPU (written again, its CPU block taken, freed): wasted.
    ahead_chunks: int = 0
    ahead_reclaimed_chunks: int = 0
    ahead_read_chunks: int = 0
    ahead_wasted_chunks: int = 0
    running: int = 0
    waiting: int = 0


@dataclass(frozen=True)
class SharingUsage:
    """Chunks held by more than one conversation, stored once."""

    chunks: int = 0
    holders: int = 0  # sum over those chunks of the conversations holding each

    @property
    def saved_blocks(self) -> int:
        """Blocks a copy per conversation would take on top of these."""
        return self.holders - self.chunks


@dataclass(frozen=True)
class PinUsage:
    """Conversations a client pinned in memory (`Retention.ttl_s`), and their chunks' bytes
    per tier (a chunk on the GPU with a CPU copy counts on both)."""

    conversations: int = 0
    gpu_bytes: int = 0
    cpu_bytes: int = 0


@dataclass(frozen=True)
class ConversationInfo:
    id: str
    tokens: int  # tokens in its stream
    # tier of each chunk: "gpu", "cpu", "disk", "dropped" or "gone" (every layer's window
    # left it: held nowhere, needed by no query)
    chunks: tuple[str, ...]
    holders: tuple[int, ...]  # conversations holding each chunk: 2 or more when shared
    running: bool
    idle_s: float | None  # None: never active
    retention: float | None  # value of its first held chunk; None: it holds nothing


@dataclass(frozen=True)
class EngineSnapshot:
    device: str
    model: str
    chunk_size: int
    cache_mode: str
    eviction: str
    gpu: PoolUsage
    cpu: PoolUsage
    counters: EngineCounters
    conversations: tuple[ConversationInfo, ...]
    context_limit: int  # most tokens one conversation can hold
    sharing: SharingUsage = SharingUsage()
    disk: PoolUsage | None = None  # the disk tier, in chunks (None: off)
    pins: PinUsage = PinUsage()
    # KV bytes in use per tier and layer type: {"gpu": {"full": b, "sliding": b}, "cpu": ...}
    # (a model whose sliding layers keep only their window: engine/kv_layout.py)
    kv_bytes: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "model": self.model,
            "chunk_size": self.chunk_size,
            "cache_mode": self.cache_mode,
            "eviction": self.eviction,
            "pools": {
                "gpu": asdict(self.gpu),
                "cpu": asdict(self.cpu),
                **({"disk": asdict(self.disk)} if self.disk else {}),
            },
            "counters": asdict(self.counters),
            "sharing": {**asdict(self.sharing), "saved_blocks": self.sharing.saved_blocks},
            "pins": asdict(self.pins),
            "kv_bytes": self.kv_bytes,
            "conversations": [
                {**asdict(c), "chunks": list(c.chunks), "holders": list(c.holders)}
                for c in self.conversations
            ],
        }


class Held(NamedTuple):
    """One conversation as `Engine.capture` reads it: its table's layout in counts."""

    id: str
    tokens: int  # tokens in its stream
    dropped: int  # leading chunks that hold nothing
    shared: tuple[tuple[str, int], ...]  # the shared run after them: (tier, holders) each
    cpu: int  # then chunks on the CPU tier only
    gpu: int  # then chunks with a GPU block
    disk: tuple[int, ...]  # the dropped chunks the disk tier holds
    running: bool
    last_active: float | None
    retention: float | None
    gone: int = 0  # of the dropped ones, those no query reads again (every layer slides)

    def info(self, now: float) -> ConversationInfo:
        tiers = ["dropped"] * self.dropped
        for j in self.disk:
            tiers[j] = "disk"
        tiers[: self.gone] = ["gone"] * self.gone
        tiers += [tier for tier, _ in self.shared]
        tiers += ["cpu"] * self.cpu + ["gpu"] * self.gpu
        rest = (1,) * (self.cpu + self.gpu)
        return ConversationInfo(
            id=self.id,
            tokens=self.tokens,
            chunks=tuple(tiers),
            holders=(1,) * self.dropped + tuple(h for _, h in self.shared) + rest,
            running=self.running,
            idle_s=None if self.last_active is None else max(0.0, now - self.last_active),
            retention=self.retention,
        )


@dataclass(frozen=True)
class Capture:
    """What a snapshot is built from: everything but the conversations, and each of them
    as `Held` at time `now`."""

    now: float
    head: EngineSnapshot  # its conversations left empty
    held: tuple[Held, ...]

    def build(self) -> EngineSnapshot:
        return replace(self.head, conversations=tuple(h.info(self.now) for h in self.held))
