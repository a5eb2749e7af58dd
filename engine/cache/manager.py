"""KVCacheManager: the chunk tables of all conversations over a GPU and a CPU block pool.

Pure bookkeeping: it decides where every chunk lives and returns the copies that the
KV pool must carry out (`CopyPlan`); it never touches a tensor. It is the only writer of
the chunk tables, and the facade over the parts that do each job:

- `Tiers` (tiers.py): the block pools, each chunk's blocks and the counts admission asks for;
- `EvictionOrder` (order.py): which chunk each tier gives up next;
- `Evictor` (eviction.py): freeing blocks in that order, ahead-of-time swap-out;
- `Sharing` (sharing.py): shared prefixes, linked by hash chain and reference-counted;
- `PrefetchSwapIn` (swap_in_ahead.py): CPU chunks back to the GPU while a user is typing;
- `Spills` (to_disk.py): chunks that lose their last copy in memory, for the disk tier.

The manager itself admits, grows, releases, suspends and cuts back conversations' turns.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.cache.chunks import BOTH, CPU, DISK, DROPPED, GPU, RESIDENCIES, Chunk, ChunkTable
from engine.cache.eviction import Evictor
from engine.cache.order import REORDER_S, UNEXPECTED, EvictionOrder
from engine.cache.policy import Policy
from engine.cache.sharing import Sharing, chain_hashes
from engine.cache.swap_in_ahead import PrefetchSwapIn
from engine.cache.tiers import Tiers
from engine.cache.to_disk import Spill, Spills
from engine.copies import CopyPlan
from engine.snapshot import EngineCounters
from engine.types import CacheMode

__all__ = ["Admission", "KVCacheManager", "chain_hashes"]


class NoRoom(MemoryError):
    """An admission found less room than `can_admit` foresaw (a client's pins hold blocks it
    could not count exactly): the turn waits. `copies`: the swap-outs of what was evicted
    before the room ran out, to run all the same (those chunks have left their blocks)."""

    def __init__(self, need: int, copies: CopyPlan) -> None:
        super().__init__(f"no room on the GPU for {need} blocks")
        self.copies = copies


@dataclass
class Admission:
    cached_tokens: int  # context already on the GPU
    swapped_in_tokens: int  # context coming back from the CPU
    recompute_tokens: int  # leading positions [0, n) to recompute from raw history
    prefetched_tokens: int = 0  # of cached_tokens: those a prefetch brought back
    copies: CopyPlan = field(default_factory=CopyPlan)  # swap-outs to make room, swap-ins
    loads: list[tuple[int, int]] = field(default_factory=list)  # (chunk, gpu block) from disk
    disk_tokens: int = 0  # context those loads bring back
    # Positions [recompute_from, kv_len) are recomputed too, with the turn's own tokens: the
    # dropped chunks after those loaded from disk (kv_len when there are none)
    recompute_from: int | None = None


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
    ) -> None:
        self.chunk_size = chunk_size
        self.policy = policy
        self.mode = mode
        self.share = share and mode == CacheMode.PENSIEVE  # the baselines keep their behaviour
        self.admit_reserve = admit_reserve
        self.tables: dict[str, ChunkTable] = {}
        self.shared: dict[Chunk, None] = {}  # every live shared chunk
        self.counters = EngineCounters() if counters is None else counters  # adds to it
        # The parts, each holding the shared state it needs (the dicts, pools and counters
        # above are these same objects, never rebound).
        self.order = EvictionOrder(self.tables, self.shared, policy, now, reorder_s)
        cpu_blocks = cpu_blocks if mode == CacheMode.PENSIEVE else 0
        self.tiers = Tiers(gpu_blocks, cpu_blocks, self.order, self.counters)
        self.gpu, self.cpu = self.tiers.gpu, self.tiers.cpu
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

    # ---- admission and growth of running turns -------------------------------------------

    def recompute_tokens(self, t: ChunkTable, kv_len: int) -> int:
        """Leading positions an admission now would recompute from raw history."""
        if t.n_dropped == 0:
            return 0
        return min(t.n_shared * self.chunk_size, kv_len)  # its shared run is let go too

    def blocks_needed(self, t: ChunkTable, upto: int) -> int:
        """GPU blocks a turn must allocate to hold positions [0, upto) on the GPU."""
        on_gpu = t.n_gpu + sum(1 for c in t.shared_run() if c.gpu is not None)
        return self.n_chunks(upto) - on_gpu

    def pinned_blocks(self) -> int:
        return self.tiers.pinned_gpu

    def reclaimable(self) -> int:
        """GPU blocks that can be freed at no cost: chunks of idle turns that have a CPU copy."""
        return self.tiers.reclaimable

    def can_admit(self, t: ChunkTable, upto: int) -> bool:
        """Admit while a share `admit_reserve` of the GPU pool stays unpinned for decoding."""
        pinned = self.tiers.pinned_gpu
        # shared chunks another running turn holds are pinned already
        held = 0 if t.n_dropped else sum(1 for c in t.shared_run() if c.pins)
        after = pinned + self.n_chunks(upto) - held + self.stuck_blocks(t)
        if pinned == 0:
            return after <= self.gpu.num_blocks
        return after <= self.gpu.num_blocks * (1.0 - self.admit_reserve)

    def stuck_blocks(self, but: ChunkTable | None = None) -> int:
        """GPU blocks no eviction can free: GPU chunks of idle conversations a client pinned
        (`Policy.pins`; `but` left out) that cannot move to the CPU tier. A pinned chunk
        moves only into a CPU block that is free or held by a chunk that may be dropped (not
        a pinned conversation's, a running turn's or `but`'s), and a table's GPU chunks leave
        front first: once those blocks run out, its GPU chunks from its first one without a
        CPU copy on stay. 0 without pins; else O(tables) plus the chunks of those held."""
        pins = self.policy.pins
        if not pins.pins and not pins.holds:
            return 0
        now = self.order.step_now
        held = [t for cid in pins.holding()
                if (t := self.tables.get(cid)) is not None and t is not but and not t.pinned
                and pins.held(cid, now)]  # fmt: skip
        if not held:
            return 0
        kept = {id(t) for t in held}
        fixed: set[int] = set()  # CPU chunks no eviction drops (a shared one counts once)
        for t in self.tables.values():
            if t.pinned or t is but or id(t) in kept:
                fixed.update(id(c) for c in t.chunks if c.cpu is not None)
        room = self.cpu.num_blocks - len(fixed)
        stuck = 0
        seen: set[int] = set()
        for t in held:
            for c in t.shared_run():  # linked first-prompt chunks: each its own candidate
                if c.gpu is None or c.cpu is not None or id(c) in seen:
                    continue
                if but is not None and but in (c.holders or ()):
                    continue  # the turn admitted needs it on the GPU anyway
                seen.add(id(c))
                room, stuck = (room - 1, stuck) if room > 0 else (room, stuck + 1)
            gpu = t.chunks[t.n_off_gpu :]
            for j, c in enumerate(gpu):
                if c.cpu is not None:
                    continue  # reclaimed for free once the chunks before it are gone
                if room == 0:
                    stuck += len(gpu) - j
                    break
                room -= 1
        return stuck

    def can_prefetch(self, t: ChunkTable, upto: int) -> bool:
        """Admit a prefetch of `t` as a turn, but only into blocks that are free or held by
        idle chunks of conversations nobody is typing in (`PrefetchSwapIn.room_for`)."""
        if not self.can_admit(t, upto):
            return False
        return self.prefetching.room_for(self.blocks_needed(t, upto))

    def loadable(self, t: ChunkTable) -> int:
        """Dropped chunks an admission may take from the disk tier instead of recomputing:
        the whole dropped run, when no shared run follows it (else it is recomputed); none
        without a disk tier."""
        return t.n_dropped if self.spilling and t.n_dropped == t.n_shared else 0

    def admit(
        self,
        t: ChunkTable,
        kv_len: int,
        upto: int,
        prefetch: bool = False,
        loaded: tuple[int, int] | None = None,
    ) -> Admission:
        """Pin the table and give every chunk of [0, upto) a GPU block. `kv_len` positions
        have KV (held or dropped); positions from there on are about to be written.
        `prefetch`: the turn only brings the context back ahead of the user's message.
        `loaded`: chunks [first, last) of the dropped run (of `loadable` chunks) come from
        the disk tier; the chunks before and after them are recomputed."""
        copies = CopyPlan()
        cs = self.chunk_size
        if loaded and not (0 <= loaded[0] < loaded[1] <= self.loadable(t)):
            raise ValueError(f"cannot load chunks {loaded} of {t.id!r} from disk")
        if t.n_dropped:  # recomputed from position 0: its shared run is recomputed too
            self.sharing.let_go(t)
        first, last = loaded or (t.n_dropped, t.n_dropped)
        self.tiers.set_pinned(t, True)
        prefetched = 0
        for i, c in enumerate(t.chunks):  # found again on the GPU thanks to a prefetch
            if c.prefetched and c.gpu is not None:
                prefetched += max(0, min(cs, kv_len - i * cs))
            c.prefetched = False
        need = self.blocks_needed(t, upto)
        if not self.evictor.make_room_gpu(need, copies, UNEXPECTED if prefetch else None):
            self.tiers.set_pinned(t, False)
            self.order.changed(t)
            raise NoRoom(need, copies)
        t.tokens = kv_len
        cached = max(0, min(kv_len, len(t.chunks) * cs) - t.n_off_gpu * cs)
        swapped = recompute = from_disk = 0
        loads = []
        # the dropped positions after the loaded chunks (a partly filled last chunk)
        tail = max(0, min(kv_len, t.n_dropped * cs) - last * cs) if loaded else 0
        for i in range(t.n_off_gpu):
            chunk = t.chunks[i]
            tokens = min(cs, kv_len - i * cs)
            if chunk.gpu is not None:  # a shared chunk already on the GPU
                cached += tokens
                continue
            self.tiers.set_gpu(t, chunk)
            chunk.prefetched = prefetch
            if chunk.cpu is not None:
                copies.swap_in.append((chunk.cpu, chunk.gpu))
                swapped += tokens
            elif first <= i < last:
                loads.append((i, chunk.gpu))
                from_disk += tokens
            else:
                recompute += tokens
        # Dropped chunks are a prefix, so recomputing positions [0, recompute) restores them
        # (with those loaded from disk: [0, first) and [last, kv_len), the turn's tokens next).
        assert recompute == min(first * cs, kv_len) + tail
        if t.n_dropped:  # recomputed chunks are private (the shared run was let go)
            t.n_dropped = t.n_shared = 0
        t.n_off_gpu = t.n_shared
        self._extend(t, upto)
        self._will_write(t, kv_len)
        self.counters.cached_tokens += cached
        self.counters.swapped_in_tokens += swapped
        self.counters.recomputed_tokens += recompute
        self.counters.disk_tokens += from_disk
        if prefetch:
            self.counters.prefetched_tokens += swapped
        return Admission(
            cached, swapped, recompute - tail, prefetched, copies, loads, from_disk,
            last * cs if tail else None,
        )  # fmt: skip

    def grow(
        self, t: ChunkTable, kv_len: int, upto: int, copies: CopyPlan | None = None
    ) -> CopyPlan | None:
        """Room for a running turn to compute positions [kv_len, upto): the copies that make
        it (added to `copies` when given: a step's plan, so that a decode allocates none),
        or None if none can be made. The copies of what was evicted before the room ran out
        are kept in `copies` all the same: those chunks have left their GPU blocks."""
        copies = CopyPlan() if copies is None else copies
        need = self.n_chunks(upto) - len(t.chunks)
        if need > 0 and not self.evictor.make_room_gpu(need, copies):
            return None
        self._extend(t, upto)
        self._will_write(t, kv_len)
        return copies

    def release(self, t: ChunkTable, kv_len: int) -> None:
        """The turn ended with `kv_len` positions computed: unpin, keep the KV (or drop it
        all in stateless mode)."""
        self._trim(t, kv_len)
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
        for c in t.chunks[keep:]:
            self.sharing.free_chunk(t, c)
        del t.chunks[keep:]
        t.tokens = length
        t.n_dropped = min(t.n_dropped, keep)
        t.n_shared = min(t.n_shared, keep)
        t.n_off_gpu = min(t.n_off_gpu, keep)
        self.order.changed(t)

    # ---- a seeded state (engine/seed.py) ---------------------------------------------------

    def blocks_to_place(self, tiers: Sequence[str], tokens: int) -> tuple[int, int]:
        """The GPU and CPU blocks `place` takes for this residency. ValueError where this
        cache cannot hold it: not one tier of `RESIDENCIES` per chunk of `tokens` positions,
        a layout other than [dropped or disk | cpu | gpu or both], a tier its mode lacks (a
        CPU tier in gpu-only and stateless mode), a chunk on disk without a disk tier or not
        full. (A stateless cache holds GPU chunks only while a turn runs: seeded, they stand
        for a turn that goes on, and are dropped when the conversation's next turn ends.)"""
        if len(tiers) != self.n_chunks(tokens):
            raise ValueError(
                f"{len(tiers)} tiers for {tokens} positions ({self.n_chunks(tokens)} chunks)"
            )
        rank = {DROPPED: 0, DISK: 0, CPU: 1, GPU: 2, BOTH: 2}
        last, gpu, cpu = 0, 0, 0
        for i, tier in enumerate(tiers):
            if tier not in rank:
                raise ValueError(f"chunk {i}: unknown tier {tier!r}, not one of {RESIDENCIES}")
            if rank[tier] < last:
                raise ValueError(
                    f"chunk {i} on {tier} after a chunk on a faster tier: a table is laid "
                    "out [dropped or disk | cpu | gpu or both]"
                )
            last = rank[tier]
            if tier == DISK and not self.spilling:
                raise ValueError(f"chunk {i} on disk: this engine has no disk tier")
            if tier == DISK and (i + 1) * self.chunk_size > tokens:
                raise ValueError(f"chunk {i} on disk is not full: only full chunks are files")
            gpu += tier in (GPU, BOTH)
            cpu += tier in (CPU, BOTH)
        if cpu and not self.cpu.num_blocks:
            raise ValueError(f"{cpu} chunks on the CPU tier: this engine has none ({self.mode})")
        return gpu, cpu

    def place(self, t: ChunkTable, tiers: Sequence[str], tokens: int) -> None:
        """Give an empty, idle table the chunks of `tokens` positions in the tiers given
        (`blocks_to_place`), through the tiers' own accounting: a seeded state, whose KV is
        whatever the blocks hold (`Engine.seed`). A chunk on "disk" is dropped here (the
        disk tier holds it). ValueError if the blocks are not free."""
        if t.chunks or t.pinned:
            raise ValueError(f"conversation {t.id!r} holds chunks already")
        gpu, cpu = self.blocks_to_place(tiers, tokens)
        if gpu > self.gpu.num_free or cpu > self.cpu.num_free:
            raise ValueError(
                f"{gpu} GPU and {cpu} CPU blocks asked, {self.gpu.num_free} and "
                f"{self.cpu.num_free} free"
            )
        for tier in tiers:
            c = Chunk()
            t.chunks.append(c)
            if tier in (GPU, BOTH):
                self.tiers.set_gpu(t, c)
            if tier in (CPU, BOTH):
                self.tiers.set_cpu(t, c, self.cpu.allocate())
        t.n_dropped = t.n_shared = sum(1 for x in tiers if x in (DROPPED, DISK))
        t.n_off_gpu = t.n_dropped + sum(1 for x in tiers if x == CPU)
        t.tokens = tokens
        self.order.changed(t)

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
        """(conversation, chunk index, tier, block) of every chunk dropped since the last
        call, whose block still holds its KV until this step's copies run."""
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
        """Blocks of the GPU tier."""
        return self.gpu.num_blocks

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

    def returned(self, gap_s: float) -> None:
        """A conversation's turn came `gap_s` after its last one ended (the `returns` value
        learns from it)."""
        self.policy.returns.returned(gap_s)

    def ended(self) -> None:
        """A turn ended (the `returns` value learns from it)."""
        self.policy.returns.ended()

    def holders(self, t: ChunkTable) -> list[int]:
        """How many conversations hold each of the table's chunks (1: its own)."""
        return [len(c.holders) if c.holders is not None else 1 for c in t.chunks]

    def check(self) -> None:
        """Assert the invariants: each table's layout, shared chunks held by exactly the
        tables that list them, one owner per block, nothing leaked, counts right."""
        tables = list(self.tables.values())
        for t in tables:
            t.check(self.chunk_size)
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

    def _extend(self, t: ChunkTable, upto: int) -> None:
        n = self.n_chunks(upto)
        while len(t.chunks) < n:
            chunk = Chunk()
            t.chunks.append(chunk)
            self.tiers.set_gpu(t, chunk)

    def _will_write(self, t: ChunkTable, start: int) -> None:
        """Positions from `start` on are about to be written: a CPU copy of their chunk goes stale."""
        i = start // self.chunk_size
        if i < len(t.chunks) and t.chunks[i].cpu is not None and t.chunks[i].gpu is not None:
            assert not t.chunks[i].shared, "a shared chunk is never written"
            # It may be the source of this step's swap-in: freed only at the next step.
            self.tiers.clear_cpu(t, t.chunks[i], stale=True)
