"""A turn's admission and growth on the GPU tier: whether it fits now (`can_admit`, with
the blocks a client's pins hold that no eviction frees), the chunks it gets there when
admitted (already there, swapped in from the CPU, loaded from the disk tier, or recomputed)
and room for a running turn to grow. `KVCacheManager` is the facade over it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.cache.chunks import Chunk, ChunkTable
from engine.cache.eviction import Evictor
from engine.cache.order import UNEXPECTED, EvictionOrder
from engine.cache.policy import Policy
from engine.cache.sharing import Sharing
from engine.cache.swap_in_ahead import PrefetchSwapIn
from engine.cache.tiers import Tiers
from engine.cache.to_disk import Spills
from engine.cache.windows import Windows
from engine.copies import CopyPlan
from engine.snapshot import EngineCounters


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
    loads: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # (chunk, GPU pages)
    disk_tokens: int = 0  # context those loads bring back
    # Positions [recompute_from, kv_len) are recomputed too, with the turn's own tokens: the
    # dropped chunks after those loaded from disk (kv_len when there are none)
    recompute_from: int | None = None


class Admitter:
    """Holds no state of its own: the tables, tiers and parts are the manager's."""

    def __init__(
        self,
        chunk_size: int,
        admit_reserve: float,
        tables: dict[str, ChunkTable],
        policy: Policy,
        tiers: Tiers,
        order: EvictionOrder,
        sharing: Sharing,
        evictor: Evictor,
        prefetching: PrefetchSwapIn,
        spills: Spills,
        counters: EngineCounters,
        windows: Windows,
    ) -> None:
        self.chunk_size = chunk_size
        self.windows = windows  # which chunks the sliding layers still read
        self.admit_reserve = admit_reserve
        self.tables = tables
        self.policy = policy  # its pins hold blocks (`stuck_blocks`)
        self.tiers = tiers
        self.gpu, self.cpu = tiers.gpu, tiers.cpu
        self.order = order
        self.sharing = sharing
        self.evictor = evictor
        self.prefetching = prefetching
        self.spills = spills  # on: a disk tier can give dropped chunks back (`loadable`)
        self.counters = counters

    def n_chunks(self, tokens: int) -> int:
        return -(-tokens // self.chunk_size)

    def recompute_tokens(self, t: ChunkTable, kv_len: int) -> int:
        """Leading positions an admission now would recompute from raw history."""
        if not t.missing:  # nothing dropped, or only chunks gone for good
            return 0
        return min(t.n_shared * self.chunk_size, kv_len)  # its shared run is let go too

    def blocks_needed(self, t: ChunkTable, upto: int) -> int:
        """GPU blocks (pages) a turn must allocate to hold positions [0, upto) on the GPU:
        with sliding groups, every page of a chunk it computes or that comes back inside the
        window (a dropped one: as if recomputed)."""
        if self.tiers.groups == 1:
            on_gpu = len(t.chunks) - t.n_off_gpu
            on_gpu += sum(1 for c in t.shared_run() if c.gpu is not None)
            return self.n_chunks(upto) - on_gpu - (0 if t.missing else t.gone)
        pages = self.tiers.pages
        last = self.windows.kept_from(t.tokens)  # a dropped chunk read back from there on
        back = sum(
            pages(c.cpu_win is not None if c.cpu is not None else i >= last)
            for i, c in enumerate(t.chunks[: t.n_off_gpu])
            if c.gpu is None
        )
        return back + max(0, self.n_chunks(upto) - len(t.chunks)) * pages(True)

    def pages_held(self, t: ChunkTable, upto: int) -> int:
        """GPU pages a turn holds once it computed up to `upto`: every chunk's full layers'
        page, and the sliding groups' pages of the chunks it computes and those the window
        of its context still reads (a recompute's steps take theirs as they go: `grow`)."""
        n = self.n_chunks(upto)
        if self.tiers.groups == 1:
            return n - (0 if t.missing else t.gone)
        start = min(t.tokens, upto)
        return n + (self.tiers.groups - 1) * (n - self.windows.kept_from(start))

    def can_admit(self, t: ChunkTable, upto: int) -> bool:
        """Admit while a share `admit_reserve` of the GPU pool stays unpinned for decoding."""
        pinned = self.tiers.pinned_gpu
        # shared chunks another running turn holds are pinned already
        held = 0 if t.n_dropped else sum(1 for c in t.shared_run() if c.pins)
        after = pinned + self.pages_held(t, upto) - held + self.stuck_blocks(t)
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
        return t.n_dropped if self.spills.spilling and t.n_dropped == t.n_shared else 0

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
        the disk tier; the chunks before and after them are recomputed. Where every layer
        slides, the chunks `gone` stay without KV when no other is missing or those loaded
        follow them; else the recompute runs from position 0 through them too."""
        copies = CopyPlan()
        cs = self.chunk_size
        if loaded and not (0 <= loaded[0] < loaded[1] <= self.loadable(t)):
            raise ValueError(f"cannot load chunks {loaded} of {t.id!r} from disk")
        if t.gone and loaded and loaded[0] <= t.gone < loaded[1]:
            loaded = (t.gone, loaded[1])  # loads from the first chunk still needed on
        elif t.missing:
            t.gone = 0
        if t.missing:  # recomputed from position 0: its shared run is recomputed too
            self.sharing.let_go(t)
            t.slid = t.gone  # the recompute gives its chunks sliding pages again
        first, last = loaded or (t.n_dropped, t.n_dropped)
        self.tiers.set_pinned(t, True)
        prefetched = 0
        for i, c in enumerate(t.chunks):  # found again on the GPU thanks to a prefetch
            if c.prefetched and c.gpu is not None:
                prefetched += max(0, min(cs, kv_len - i * cs))
            c.prefetched = False
        # the dropped positions after the loaded chunks (a partly filled last chunk)
        tail = max(0, min(kv_len, t.n_dropped * cs) - last * cs) if loaded else 0
        # Sliding pages: those a chunk had, or a chunk from disk's that a sliding layer reads
        # again, in the window of what is computed next (`Windows.loads_hold_pages` checked
        # its file); a recomputed one gets them in the steps that compute it (`grow`)
        after = last * cs if tail else kv_len
        reread = self.windows.kept_from(after)
        window = {
            i: c.cpu_win is not None if c.cpu is not None else first <= i < last and i >= reread
            for i, c in enumerate(t.chunks[: t.n_off_gpu])
            if c.gpu is None and i >= t.gone
        }
        need = sum(self.tiers.pages(w) for w in window.values())
        need += max(0, self.n_chunks(upto) - len(t.chunks)) * self.tiers.pages(True)
        if not self.evictor.make_room_gpu(need, copies, UNEXPECTED if prefetch else None):
            self.tiers.set_pinned(t, False)
            self.order.changed(t)
            raise NoRoom(need, copies)
        t.tokens = kv_len
        cached = max(0, min(kv_len, len(t.chunks) * cs) - t.n_off_gpu * cs)
        swapped = recompute = from_disk = 0
        loads = []
        for i in range(t.gone, t.n_off_gpu):
            chunk = t.chunks[i]
            tokens = min(cs, kv_len - i * cs)
            if chunk.gpu is not None:  # a shared chunk already on the GPU
                cached += tokens
                continue
            self.tiers.set_gpu(t, chunk, window[i])
            chunk.prefetched = prefetch
            if chunk.cpu is not None:
                copies.swap_in += zip(chunk.cpu_pages(), chunk.gpu_pages(), strict=True)
                swapped += tokens
            elif first <= i < last:
                loads.append((i, chunk.gpu_pages()))
                from_disk += tokens
            else:
                recompute += tokens
        # Dropped chunks are a prefix, so recomputing positions [0, recompute) restores them
        # (with those loaded from disk: [0, first) and [last, kv_len), the turn's tokens next).
        assert recompute == max(0, min(first * cs, kv_len) - t.gone * cs) + tail
        if t.missing:  # recomputed chunks are private (the shared run was let go)
            t.n_dropped = t.n_shared = t.gone
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
        self,
        t: ChunkTable,
        kv_len: int,
        upto: int,
        copies: CopyPlan | None = None,
        start: int | None = None,
    ) -> CopyPlan | None:
        """Room for a running turn to compute positions [start, upto) (`start`: kv_len, or
        where a recompute's step begins): the copies that make it (added to `copies` when
        given: a step's plan, so that a decode allocates none), or None if none can be made.
        With sliding groups the step's chunks and those its window reads get their pages.
        The copies of what was evicted before the room ran out are kept in `copies` all the
        same: those chunks have left their GPU blocks."""
        copies = CopyPlan() if copies is None else copies
        start = kv_len if start is None else start
        need = max(0, self.n_chunks(upto) - len(t.chunks)) * self.tiers.pages(True)
        bare = []  # held chunks the step's sliding layers read or write, without their pages
        # (a recompute's: past its context, every chunk the window reads holds them already)
        if self.tiers.groups > 1 and start < kv_len:
            read = t.chunks[self.windows.first(start) : self.n_chunks(upto)]
            bare = [c for c in read if c.gpu is not None and c.gpu_win is None]
            need += len(bare) * (self.tiers.groups - 1)
        if need > 0 and not self.evictor.make_room_gpu(need, copies):
            return None
        for c in bare:
            self.tiers.window_gpu(t, c)
        self._extend(t, upto)
        self._will_write(t, kv_len)
        return copies

    def _extend(self, t: ChunkTable, upto: int) -> None:
        n = self.n_chunks(upto)
        while len(t.chunks) < n:
            chunk = Chunk()
            t.chunks.append(chunk)
            self.tiers.set_gpu(t, chunk, window=True)

    def _will_write(self, t: ChunkTable, start: int) -> None:
        """Positions from `start` on are about to be written: a CPU copy of their chunk goes stale."""
        i = start // self.chunk_size
        if i < len(t.chunks) and t.chunks[i].cpu is not None and t.chunks[i].gpu is not None:
            assert not t.chunks[i].shared, "a shared chunk is never written"
            # It may be the source of this step's swap-in: freed only at the next step.
            self.tiers.clear_cpu(t, t.chunks[i], stale=True)
