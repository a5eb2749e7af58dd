"""KVCacheManager: the chunk tables of all conversations over a GPU and a CPU block pool.

Pure bookkeeping: it decides where every chunk lives and returns the copies that the
KV pool must carry out (`CopyPlan`); it never touches a tensor. It is the only writer of
the chunk tables, and the facade over the parts that do each job:

- `Tiers` (tiers.py): the block pools, each chunk's blocks and the counts admission asks for;
- `Admitter` (admission.py): a turn's admission (what fits, where each chunk comes from) and
  growth;
- `EvictionOrder` (order.py): which chunk each tier gives up next;
- `Evictor` (eviction.py): freeing blocks in that order, ahead-of-time swap-out;
- `Sharing` (sharing.py): shared prefixes, linked by hash chain and reference-counted;
- `PrefetchSwapIn` (swap_in_ahead.py): CPU chunks back to the GPU while a user is typing;
- `Spills` (to_disk.py): chunks that lose their last copy in memory, for the disk tier;
- `Windows` (windows.py): the sliding layers' pages of the chunks their window has left;
- `Placer` (placing.py): a seeded state's chunks placed in their tiers.

The manager itself holds the tables, releases, suspends and cuts back conversations' turns,
and places a seeded state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from engine.cache.admission import Admission, Admitter, NoRoom
from engine.cache.chunks import Chunk, ChunkTable
from engine.cache.eviction import Evictor
from engine.cache.order import REORDER_S, EvictionOrder
from engine.cache.placing import Placer
from engine.cache.policy import Policy
from engine.cache.sharing import Sharing, chain_hashes
from engine.cache.swap_in_ahead import PrefetchSwapIn
from engine.cache.tiers import Tiers
from engine.cache.to_disk import Spill, Spills
from engine.cache.windows import Windows
from engine.copies import CopyPlan
from engine.kv_layout import KVLayout
from engine.snapshot import EngineCounters
from engine.types import CacheMode

__all__ = ["Admission", "KVCacheManager", "NoRoom", "chain_hashes"]


class KVCacheManager:
    def __init__(
        self,
        gpu_blocks: int,
        cpu_blocks: int,
        chunk_size: int,
        policy: Policy,
        mode: CacheMode = CacheMode.PENSIEVE,
        admit_reserve: float = 0.10,
        swap_out_threshold: float = 0.25,
        now: Callable[[], float] = time.time,
        share: bool = False,
        counters: EngineCounters | None = None,
        reorder_s: float = REORDER_S,
        layout: KVLayout | None = None,
    ) -> None:
        self.chunk_size = chunk_size
        self.policy = policy
        self.mode = mode
        # Pages per layer group (engine/kv_layout.py): None, one group (blocks are chunks)
        groups = 1 if layout is None else layout.groups
        # The baselines keep their behaviour; prefixes are not shared where layers keep only
        # their window (each holder's window leaves a shared chunk at another time)
        windows = layout is not None and layout.window is not None
        self.share = share and mode == CacheMode.PENSIEVE and not windows
        self.tables: dict[str, ChunkTable] = {}
        self.shared: dict[Chunk, None] = {}  # every live shared chunk
        self.counters = EngineCounters() if counters is None else counters  # adds to it
        # The parts, each holding the shared state it needs (the dicts, pools and counters
        # above are these same objects, never rebound).
        self.order = EvictionOrder(self.tables, self.shared, policy, now, reorder_s)
        cpu_blocks = cpu_blocks if mode == CacheMode.PENSIEVE else 0
        self.tiers = Tiers(gpu_blocks, cpu_blocks, self.order, self.counters, groups)
        self.gpu, self.cpu = self.tiers.gpu, self.tiers.cpu
        self.windows = Windows(layout, chunk_size, self.tiers)
        self.spills = Spills(chunk_size, self.counters)
        self.sharing = Sharing(
            self.share, chunk_size, self.shared, self.tiers, self.order, self.spills, self.counters
        )
        self.evictor = Evictor(
            chunk_size,
            swap_out_threshold,
            self.tiers,
            self.order,
            self.sharing,
            self.spills,
            self.counters,
        )
        self.prefetching = PrefetchSwapIn(
            mode, chunk_size, self.tiers, self.order, self.evictor, self.counters
        )
        self.admission = Admitter(
            chunk_size,
            admit_reserve,
            self.tables,
            policy,
            self.tiers,
            self.order,
            self.sharing,
            self.evictor,
            self.prefetching,
            self.spills,
            self.counters,
            self.windows,
        )
        self.placer = Placer(chunk_size, mode, self.tiers, self.order, self.spills, self.windows)

    @property
    def spilling(self) -> bool:
        """A disk tier takes dropped chunks (`take_spills`)."""
        return self.spills.spilling

    @spilling.setter
    def spilling(self, on: bool) -> None:
        self.spills.spilling = on

    # ---- steps and tables -------------------------------------------------------------------

    def begin_step(self) -> None:
        """A new step: one time for every eviction decision in it. The previous step's copies
        are queued, so the CPU blocks whose copy went stale can be handed out again."""
        self.order.begin_step()
        self.tiers.begin_step()
        self.spills.begin_step()

    def table(self, conversation_id: str) -> ChunkTable:
        t = self.tables.get(conversation_id)
        if t is None:
            t = self.tables[conversation_id] = ChunkTable(conversation_id)
        return t

    def forget(self, conversation_id: str) -> None:
        t = self.tables.get(conversation_id)
        if t is None:
            return
        if t.pinned:
            raise RuntimeError(f"conversation {conversation_id!r} is running")
        for c in t.chunks:
            self.sharing.free_chunk(t, c)
        t.chunks.clear()
        t.n_dropped = t.n_shared = t.n_off_gpu = 0
        del self.tables[conversation_id]

    def reset(self, t: ChunkTable, tokens: int) -> None:
        """Hold nothing: `tokens` positions, all dropped (known only to the raw history)."""
        for c in t.chunks:
            self.sharing.free_chunk(t, c)
        n = self.n_chunks(tokens)
        t.chunks = [Chunk() for _ in range(n)]
        t.n_dropped = t.n_shared = t.n_off_gpu = n
        t.tokens = tokens
        t.gone = t.slid = self.windows.gone_before(tokens)  # none of them needed back

    def n_chunks(self, tokens: int) -> int:
        return -(-tokens // self.chunk_size)

    # ---- shared prefixes (sharing.py) --------------------------------------------------------

    def link(self, t: ChunkTable, hashes: list[bytes]) -> int:
        """Hold the shared chunks with hash chain `hashes` from position 0 on (`Sharing.link`)."""
        return self.sharing.link(t, hashes)

    def link_prompt(self, t: ChunkTable, prompt: list[int]) -> tuple[list[bytes], int]:
        """A conversation starts: link the shared chunks its first prompt starts with (its
        last token is always computed, for the logits of the first reply token). Returns
        the prompt's hash chain (published when its turn ends) and the positions linked."""
        if not self.share or t.chunks:
            return [], 0
        chain = chain_hashes(prompt, self.chunk_size)
        return chain, self.link(t, chain[: (len(prompt) - 1) // self.chunk_size])

    def fork(self, parent: ChunkTable, child_id: str, chain: list[bytes], kv_len: int) -> int:
        """A new conversation `child_id` starts as a copy of `parent` (`chain`: the hash
        chain of the copied tokens, `kv_len`: the parent's computed positions): the parent's
        full chunks of them are published and the child links them. Returns the positions
        linked (0: none, and the child is not kept; sharing is off)."""
        if not self.share:
            return 0
        n = min(len(chain), kv_len // self.chunk_size)
        self.publish(parent, chain[:n])
        linked = self.link(self.table(child_id), chain[:n])
        if not linked:
            self.forget(child_id)
        return linked

    def publish(self, t: ChunkTable, hashes: list[bytes]) -> None:
        """Let other conversations link the chunks with hash chain `hashes` (`Sharing.publish`)."""
        self.sharing.publish(t, hashes)

    # ---- admission and growth of running turns (admission.py) ---------------------------

    def recompute_tokens(self, t: ChunkTable, kv_len: int) -> int:
        """Leading positions an admission now would recompute from raw history."""
        return self.admission.recompute_tokens(t, kv_len)

    def pinned_blocks(self) -> int:
        return self.tiers.pinned_gpu

    def reclaimable(self) -> int:
        """GPU blocks that can be freed at no cost: chunks of idle turns that have a CPU copy."""
        return self.tiers.reclaimable

    def can_admit(self, t: ChunkTable, upto: int) -> bool:
        """Admit while a share `admit_reserve` of the GPU pool stays unpinned for decoding."""
        return self.admission.can_admit(t, upto)

    def stuck_blocks(self, but: ChunkTable | None = None) -> int:
        """GPU blocks no eviction can free: idle chunks pinned by a client (`Admitter`)."""
        return self.admission.stuck_blocks(but)

    def can_prefetch(self, t: ChunkTable, upto: int) -> bool:
        """Admit a prefetch of `t` as a turn, into room that no one typing is owed."""
        return self.admission.can_prefetch(t, upto)

    def loadable(self, t: ChunkTable) -> int:
        """Dropped chunks an admission may take from the disk tier instead of recomputing."""
        return self.admission.loadable(t)

    def admit(
        self,
        t: ChunkTable,
        kv_len: int,
        upto: int,
        prefetch: bool = False,
        loaded: tuple[int, int] | None = None,
    ) -> Admission:
        """Pin the table and give every chunk of [0, upto) a GPU block (`Admitter.admit`);
        NoRoom if the room ran out."""
        return self.admission.admit(t, kv_len, upto, prefetch, loaded)

    def grow(
        self,
        t: ChunkTable,
        kv_len: int,
        upto: int,
        copies: CopyPlan | None = None,
        start: int | None = None,
    ) -> CopyPlan | None:
        """Room for a running turn to compute positions [start or kv_len, upto): the copies
        that make it, or None if none can be made (`Admitter.grow`)."""
        return self.admission.grow(t, kv_len, upto, copies, start)

    # ---- the rest of a turn's life ---------------------------------------------------------

    def release(self, t: ChunkTable, kv_len: int) -> None:
        """The turn ended with `kv_len` positions computed: unpin, keep the KV (or drop it
        all in stateless mode)."""
        self._trim(t, kv_len)
        self.windows.slide(t, kv_len)
        self.tiers.set_pinned(t, False)
        if self.mode == CacheMode.STATELESS:
            for c in t.chunks:
                self.sharing.free_chunk(t, c)
            t.n_dropped = t.n_shared = t.n_off_gpu = len(t.chunks)
        self.order.changed(t)

    def suspend(self, t: ChunkTable, kv_len: int) -> CopyPlan:
        """Take a running turn's KV off the GPU (to the CPU where it fits) so others can
        decode; returns the swap-outs. Its shared chunks stay where they are, unpinned."""
        copies = CopyPlan()
        self._trim(t, kv_len)
        self.windows.slide(t, kv_len)
        self.tiers.set_pinned(t, False)
        while t.n_off_gpu < len(t.chunks):
            self.evictor.evict_front_gpu(t, copies, force=True)
        self.counters.suspensions += 1
        self.order.changed(t)
        return copies

    def drop_prefix(self, t: ChunkTable, tokens: int) -> None:
        """Positions [0, tokens) hold no valid KV (a recompute stopped half way): drop them."""
        k = min(self.n_chunks(tokens), len(t.chunks))
        if k > t.n_dropped:
            self.sharing.let_go(t)
        for c in t.chunks[:k]:
            self.sharing.free_chunk(t, c)
        t.n_dropped = max(t.n_dropped, k)
        t.n_shared = max(t.n_shared, k)
        t.n_off_gpu = max(t.n_off_gpu, k)
        self.order.changed(t)

    def truncate(self, t: ChunkTable, length: int) -> None:
        """Forget positions from `length` on (the caller's history says the stream is shorter)."""
        if t.pinned:
            raise RuntimeError("cannot truncate a running conversation")
        if length >= t.tokens:
            return
        keep = self.n_chunks(length)
        if keep > length // self.chunk_size and keep <= t.n_shared:
            # The cut falls inside a shared chunk, which is never written: recompute instead.
            self.sharing.let_go(t)
        if self.windows.moves_back(t, length):  # over chunks without sliding pages
            self.drop_prefix(t, min(length, t.slid * self.chunk_size))
            t.slid = t.gone = 0  # recomputed from position 0
        for c in t.chunks[keep:]:
            self.sharing.free_chunk(t, c)
        del t.chunks[keep:]
        t.tokens = length
        t.n_dropped = min(t.n_dropped, keep)
        t.n_shared = min(t.n_shared, keep)
        t.n_off_gpu = min(t.n_off_gpu, keep)
        self.order.changed(t)

    # ---- a seeded state (placing.py) --------------------------------------------------------

    def blocks_to_place(self, tiers: Sequence[str], tokens: int) -> tuple[int, int]:
        """The GPU and CPU blocks `place` takes for this residency (`Placer.blocks`)."""
        return self.placer.blocks(tiers, tokens)

    def place(self, t: ChunkTable, tiers: Sequence[str], tokens: int) -> None:
        """Give an empty, idle table the chunks of `tokens` positions in the tiers given: a
        seeded state (`Placer.place`)."""
        self.placer.place(t, tiers, tokens)

    # ---- prefetch (swap_in_ahead.py), swap-out ahead (eviction.py), spills (to_disk.py) ---

    def on_cpu(self, t: ChunkTable) -> bool:
        """The idle table holds chunks on the CPU tier only: a prefetch can bring them back."""
        return self.prefetching.on_cpu(t)

    def prefetch(self, t: ChunkTable) -> tuple[CopyPlan, bool]:
        """Copy the idle, expected table's CPU chunks back to the GPU (`PrefetchSwapIn.prefetch`):
        the swap-ins, and whether nothing is left to bring back."""
        return self.prefetching.prefetch(t)

    def swap_out_ahead(self, busy: bool = False) -> CopyPlan:
        """Copy the lowest-value chunks to the CPU in the background when free GPU blocks
        fall under the target (`Evictor.swap_out_ahead`)."""
        return self.evictor.swap_out_ahead(busy)

    def take_spills(self) -> list[Spill]:
        """(conversation, chunk index, tier, pages) of every chunk dropped since the last
        call, whose pages still hold its KV until this step's copies run."""
        return self.spills.take()

    # ---- inspection -----------------------------------------------------------------------

    def lowest_value(self, t: ChunkTable, now: float) -> float | None:
        """Retention value of the table's first chunk still held in a tier."""
        if t.n_dropped >= len(t.chunks):
            return None
        return self.policy.value(t, t.n_dropped, now)

    # ---- facts for the engine ------------------------------------------------------------

    def find(self, conversation_id: str) -> ChunkTable | None:
        return self.tables.get(conversation_id)

    def held(self) -> list[ChunkTable]:
        """Every conversation's table."""
        return list(self.tables.values())

    def gpu_capacity(self) -> int:
        """Chunks of every layer's KV the GPU tier holds (its blocks; with sliding groups,
        its pages over the pages a chunk inside the window holds)."""
        return self.gpu.num_blocks // self.tiers.groups

    def usage(self, tier: str) -> tuple[int, int, int]:
        """A tier's blocks: total, used, free."""
        pool = self.gpu if tier == "gpu" else self.cpu
        return pool.num_blocks, pool.num_used, pool.num_free

    def sharing_usage(self) -> tuple[int, int]:
        """Chunks held by more than one conversation, and the holders of those chunks."""
        held = [len(s.holders) for s in self.shared if len(s.holders) > 1]
        return len(held), sum(held)

    def spill_to(self, restore_s: Callable[[], float | None]) -> None:
        """A disk tier takes dropped chunks (`take_spills`); `restore_s`: seconds to read a
        chunk back from it, which caps a chunk's value (`Policy`)."""
        self.spilling = True
        self.policy.restore_s = restore_s

    def holders(self, t: ChunkTable) -> list[int]:
        """How many conversations hold each of the table's chunks (1: its own)."""
        return [len(c.holders) if c.holders is not None else 1 for c in t.chunks]

    def check(self) -> None:
        """Assert the invariants: each table's layout, shared chunks held by exactly the
        tables that list them, one owner per block, nothing leaked, counts right."""
        tables = list(self.tables.values())
        for t in tables:
            t.check(self.chunk_size)
            self.windows.check(t)
        self.sharing.check(tables)
        self.tiers.check(tables, self.shared)

    # ---- internals ------------------------------------------------------------------------

    def _trim(self, t: ChunkTable, kv_len: int) -> None:
        """Keep the chunks of positions [0, kv_len): the rest were allocated but not written."""
        t.tokens = kv_len
        keep = self.n_chunks(kv_len)
        for c in t.chunks[keep:]:
            self.sharing.free_chunk(t, c)
        del t.chunks[keep:]
