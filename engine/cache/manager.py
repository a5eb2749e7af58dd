"""KVCacheManager: the chunk tables of all conversations over a GPU and a CPU block pool.

Pure bookkeeping: it decides where every chunk lives and returns the copies that the
KV pool must carry out (`CopyPlan`); it never touches a tensor. It is the only writer of
the chunk tables.

Cost per step: the counts that admission and ahead-of-time swap-out ask for (pinned and
reclaimable blocks) are kept up to date as chunks move, so asking is O(1). Eviction pops
from one lazy heap per candidate kind; as a chunk's value Cost(l) / T depends on the time
of the step, a heap is built at most once per step, on the first eviction of that kind,
and each eviction after that is O(log n).

Shared prefixes (pensieve mode, `share=True`): when a conversation's first turn ends,
the full chunks of its first prompt are published under a hash chain (`chain_hashes`);
a conversation that starts with the same tokens links them instead of computing them
(`link`), and one that computed them anyway hands its copy back (`publish`). A shared
chunk is one `Chunk` held by every holder at the same index, never written again (it is
full), pinned while any holder runs, an eviction candidate of its own whose value is the
sum of its holders' values, and freed when its last holder lets go. A holder lets go of
its whole shared run when it must recompute (it has dropped chunks before it, or the run
must give way to a dropped private chunk after it), and of the run's tail when it is cut
back (truncation). Each table stays laid out [dropped | shared | CPU | GPU].

Prefetch (`prefetch`): a user is typing in an idle conversation, so its CPU chunks are
copied back to GPU blocks that are free, or taken from idle chunks worth less (reclaimed
at no cost where they have a CPU copy), from the back of its CPU run (the chunk next to
its GPU run) first. They keep their
CPU copies: if the user never sends, they are reclaimed for free once they are worth less
than others (their value falls with idle time like any other chunk's). The next admission
counts the tokens prefetch brought back that are still on the GPU (`prefetched_tokens`).
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import time
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine.cache.blocks import BlockPool
from engine.cache.chunks import Chunk, ChunkTable
from engine.cache.policy import Policy
from engine.copies import CopyPlan
from engine.snapshot import EngineCounters


def chain_hashes(tokens: list[int], chunk_size: int, prev: bytes = b"") -> list[bytes]:
    """Hash of each full chunk of `tokens`, chained: equal hashes mean equal tokens at
    equal positions from position 0 on."""
    out = []
    for start in range(0, len(tokens) - chunk_size + 1, chunk_size):
        chunk = array("q", tokens[start : start + chunk_size]).tobytes()
        prev = hashlib.blake2b(prev + chunk, digest_size=16).digest()
        out.append(prev)
    return out


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


class _LazyHeap:
    """Min-heap over chunk tables by the key of their front candidate chunk (and over shared
    chunks, each its own candidate). Entries are re-checked when popped, so it stays right
    while chunks move as long as a table whose front may have got cheaper is pushed again
    (`push`); only an item's latest entry counts, the others are dropped when popped. Built
    on first use; `reset` when keys change."""

    def __init__(self, front: Callable, key: Callable) -> None:
        self.front, self.key = front, key
        self.heap: list | None = None
        self.latest: dict[int, int] = {}  # id of an item -> the order of its latest entry
        self._n = itertools.count()  # ties: never compare tables

    def reset(self) -> None:
        self.heap = None
        self.latest = {}

    def ensure(self, tables: Iterable[ChunkTable]) -> None:
        if self.heap is None:
            self.heap = []
            for t in tables:
                i = self.front(t)
                if i is not None:
                    self.heap.append(self._entry(self.key(t, i), t))
            heapq.heapify(self.heap)

    def _entry(self, key, t) -> tuple:
        n = self.latest[id(t)] = next(self._n)
        return (key, n, t)

    def push(self, t: ChunkTable) -> None:
        if self.heap is not None:
            i = self.front(t)
            if i is not None:
                heapq.heappush(self.heap, self._entry(self.key(t, i), t))

    def pop(self) -> tuple[ChunkTable, int] | None:
        heap = self.heap
        while heap:
            k, n, t = heapq.heappop(heap)
            if self.latest.get(id(t)) != n:
                continue  # an older entry of an item pushed again since
            i = self.front(t)
            if i is None:
                del self.latest[id(t)]
                continue
            k2 = self.key(t, i)
            heapq.heappush(heap, self._entry(k2, t))  # it may have more chunks to give
            if k2 == k:
                return t, i
        return None


# How long the eviction order is kept. Keys (recompute cost over idle time) are taken at
# one time and the heaps reused, until the policy's expectations change or the keys are
# older than REORDER_SHARE of the idle time of the most recently active chunk evicted since
# (so no evicted value has drifted by more than that share), at least REORDER_S (while
# nothing has been evicted yet) and at most REORDER_MAX_S. A table whose turn ends in
# between needs no rebuild: its entry is keyed again when popped (a heap re-checks every
# entry it pops), where its activity, after the keys' time, makes it as recent as can be,
# so it goes after every older chunk. Rebuilding the heaps at every turn's end, or every
# step, would cost O(conversations) per step of a few milliseconds on a GPU.
REORDER_S = 0.5
REORDER_SHARE = 0.05
REORDER_MAX_S = 10.0

# Keys of expected conversations' chunks start with True (see `Policy.key`): a bound on
# keys below which only chunks of conversations nobody is typing in are.
UNEXPECTED = (True,)


class KVCacheManager:
    def __init__(
        self,
        gpu_blocks: int,
        cpu_blocks: int,
        chunk_size: int,
        policy: Policy,
        mode: str = "pensieve",
        admit_reserve: float = 0.10,
        swap_out_threshold: float = 0.25,
        now: Callable[[], float] = time.time,
        share: bool = False,
        counters: EngineCounters | None = None,
        reorder_s: float = REORDER_S,
    ) -> None:
        self.gpu = BlockPool(gpu_blocks)
        self.cpu = BlockPool(cpu_blocks if mode == "pensieve" else 0)
        self.chunk_size = chunk_size
        self.policy = policy
        self.mode = mode
        self.share = share and mode == "pensieve"  # the baselines keep their behaviour
        self.admit_reserve = admit_reserve
        self.swap_out_threshold = swap_out_threshold
        self.now = now
        self.tables: dict[str, ChunkTable] = {}
        self.shared: dict[Chunk, None] = {}  # every live shared chunk
        self.index: dict[bytes, Chunk] = {}  # hash chain -> shared chunk that can be linked
        self.counters = EngineCounters() if counters is None else counters  # adds to it
        self._now = now()
        self.reorder_s = reorder_s
        self._key_now = self._now  # the time the heaps' keys are taken at
        self._key_expected = policy.expectations  # the policy's expectations they were taken with
        self._frontier_idle: float | None = None  # least idle time evicted since, at _key_now
        self._stale: list[int] = []  # CPU blocks to free once this step's swap-in has read them
        self._pinned_gpu = 0  # GPU blocks of pinned tables and of shared chunks they hold
        self._reclaimable = 0  # GPU blocks of idle chunks that have a CPU copy
        # The chunk each table gives up next: its first GPU chunk; its first GPU chunk with
        # no CPU copy (to copy ahead of time); its first chunk holding a CPU block. A shared
        # chunk is a candidate of its own in each heap.
        self._gpu_heap = _LazyHeap(self._gpu_front, self._key)
        self._unbacked_heap = _LazyHeap(self._unbacked_gpu_front, self._key)
        self._cpu_heap = _LazyHeap(self._cpu_front, self._key)
        self._heaps = (self._gpu_heap, self._unbacked_heap, self._cpu_heap)
        self.spilling = False  # a disk tier takes dropped chunks (`take_spills`)
        self.spills: list[tuple[str, int, str, int]] = []
        self._incoming: dict[int, int] = {}  # CPU block -> the GPU block this step swaps out to it

    # ---- steps and tables -------------------------------------------------------------------

    def begin_step(self) -> None:
        """A new step: one time for every eviction decision in it. The previous step's copies
        are queued, so the CPU blocks whose copy went stale can be handed out again."""
        self._now = self.now()
        keep = self.reorder_s
        if self._frontier_idle is not None:
            keep = min(REORDER_MAX_S, max(keep, REORDER_SHARE * self._frontier_idle))
        if self._now - self._key_now >= keep or self._key_expected != self.policy.expectations:
            self._key_now, self._key_expected = self._now, self.policy.expectations
            self._frontier_idle = None
            for heap in self._heaps:
                heap.reset()
        for block in self._stale:
            self.cpu.release(block)
        self._stale = []
        self._incoming = {}

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
            self._free_chunk(t, c)
        t.chunks.clear()
        t.n_dropped = t.n_shared = t.n_off_gpu = 0
        del self.tables[conversation_id]

    def reset(self, t: ChunkTable, tokens: int) -> None:
        """Hold nothing: `tokens` positions, all dropped (known only to the raw history)."""
        for c in t.chunks:
            self._free_chunk(t, c)
        n = self.n_chunks(tokens)
        t.chunks = [Chunk() for _ in range(n)]
        t.n_dropped = t.n_shared = t.n_off_gpu = n
        t.tokens = tokens

    def n_chunks(self, tokens: int) -> int:
        return -(-tokens // self.chunk_size)

    # ---- shared prefixes ----------------------------------------------------------------------

    def link(self, t: ChunkTable, hashes: list[bytes]) -> int:
        """A conversation starts (its table is empty) with chunks whose hash chain is
        `hashes`: hold the shared chunks that have it, from position 0 on. Returns how many
        positions they hold (their KV is computed)."""
        if not self.share or t.chunks or t.pinned:
            return 0
        for j, key in enumerate(hashes):
            c = self.index.get(key)
            if c is None or c.parent is not (t.chunks[j - 1] if j else None):
                break
            c.holders[t] = None  # type: ignore[index]
            t.chunks.append(c)
            self._changed(c)  # one more holder: it is worth more
        t.n_dropped = 0
        t.n_shared = t.n_off_gpu = len(t.chunks)
        t.tokens = len(t.chunks) * self.chunk_size
        self.counters.shared_tokens += t.tokens
        return t.tokens

    def publish(self, t: ChunkTable, hashes: list[bytes]) -> None:
        """The chunks with hash chain `hashes` (full, their KV computed) may be linked by
        other conversations. One that is already published (computed twice, e.g. by
        conversations that started together) is given up for the published one."""
        if not self.share or t.pinned or t.n_dropped:
            return
        n = min(len(hashes), t.tokens // self.chunk_size, len(t.chunks))
        for j in range(t.n_shared, n):
            parent = t.chunks[j - 1] if j else None
            c, key = t.chunks[j], hashes[j]
            x = self.index.get(key)
            if x is not None and x.parent is parent:
                self._adopt(t, j, x)
                continue
            if x is not None:  # another chain under the same hash (its start was dropped)
                x.key = None
            self._account(t, c, -1)
            c.holders, c.index, c.key, c.parent, c.pins = {t: None}, j, key, parent, 0
            self._account(t, c, 1)
            self.shared[c] = None
            self._changed(c)
            self.index[key] = c
            t.n_shared = j + 1
            t.n_off_gpu = max(t.n_off_gpu, j + 1)
        self._changed(t)

    def _adopt(self, t: ChunkTable, j: int, x: Chunk) -> None:
        """Replace the table's private chunk j by the shared chunk `x` (same tokens), giving
        `x` its blocks where it lacks them and freeing the rest."""
        c = t.chunks[j]
        self._account(t, c, -1)
        self._account(t, x, -1)
        if x.gpu is None and c.gpu is not None:
            x.gpu, c.gpu = c.gpu, None
        if x.cpu is None and c.cpu is not None:
            x.cpu, c.cpu = c.cpu, None
        self._account(t, x, 1)
        for block, pool in ((c.gpu, self.gpu), (c.cpu, self.cpu)):
            if block is not None:
                pool.release(block)
        c.gpu = c.cpu = None
        x.holders[t] = None  # type: ignore[index]
        t.chunks[j] = x
        t.n_shared = j + 1
        t.n_off_gpu = max(t.n_off_gpu, j + 1)
        self._changed(x)

    def _let_go(self, t: ChunkTable, spill: bool = False) -> None:
        """The table stops holding its shared run: those positions count as dropped.
        `spill`: by eviction (a chunk freed with it goes to the disk tier)."""
        for j in range(t.n_dropped, t.n_shared):
            c = t.chunks[j]
            t.chunks[j] = Chunk()
            if self._unref(t, c, spill):
                self.counters.dropped_tokens += self.chunk_size
        t.n_dropped = t.n_shared
        self._changed(t)

    def _unref(self, t: ChunkTable, c: Chunk, spill: bool = False) -> bool:
        """`t` no longer holds shared chunk `c`; free it if it was the last. True if freed."""
        if t.pinned:
            self._pin_shared(c, -1)
        del c.holders[t]  # type: ignore[arg-type]
        if c.holders:
            self._changed(c)  # fewer holders: it is worth less
            return False
        if spill:
            self._spill(t, c.index, c)
        self._free_shared(c)
        return True

    def _drop_shared(self, c: Chunk) -> None:
        """Free shared chunk `c` that has no copy left to keep (no holder is running)."""
        if c.parent is None:  # the first chunk all its holders hold: only it is dropped
            k = c.index
            self._spill(next(iter(c.holders)), k, c)  # type: ignore[arg-type]
            for h in list(c.holders):  # type: ignore[union-attr]
                h.chunks[k] = Chunk()
                h.n_dropped = k + 1
                if k + 1 < h.n_shared:
                    h.chunks[k + 1].parent = None  # now the first held chunk of its holders
                self._changed(h)
            c.holders = {}
            self._free_shared(c)
            self.counters.dropped_tokens += self.chunk_size
        else:  # chunks before it are held: its holders let go of their shared runs
            for h in list(c.holders):  # type: ignore[union-attr]
                self._let_go(h, spill=True)

    def _free_shared(self, c: Chunk) -> None:
        """A shared chunk no one holds: its blocks and its index entry go."""
        if c.gpu is not None:
            self._clear_gpu(None, c)
        if c.cpu is not None:
            self._clear_cpu(None, c)
        if c.key is not None and self.index.get(c.key) is c:
            del self.index[c.key]
        del self.shared[c]

    # ---- admission and growth of running turns -------------------------------------------

    def recompute_tokens(self, t: ChunkTable, kv_len: int) -> int:
        """Leading positions an admission now would recompute from raw history."""
        if t.n_dropped == 0:
            return 0
        return min(t.n_shared * self.chunk_size, kv_len)  # its shared run is let go too

    def blocks_needed(self, t: ChunkTable, upto: int) -> int:
        """GPU blocks a turn must allocate to hold positions [0, upto) on the GPU."""
        on_gpu = t.n_gpu + sum(1 for c in self._run(t) if c.gpu is not None)
        return self.n_chunks(upto) - on_gpu

    def pinned_blocks(self) -> int:
        return self._pinned_gpu

    def reclaimable(self) -> int:
        """GPU blocks that can be freed at no cost: chunks of idle turns that have a CPU copy."""
        return self._reclaimable

    def can_admit(self, t: ChunkTable, upto: int) -> bool:
        """Admit while a share `admit_reserve` of the GPU pool stays unpinned for decoding."""
        pinned = self._pinned_gpu
        # shared chunks another running turn holds are pinned already
        held = 0 if t.n_dropped else sum(1 for c in self._run(t) if c.pins)
        after = pinned + self.n_chunks(upto) - held
        if pinned == 0:
            return after <= self.gpu.num_blocks
        return after <= self.gpu.num_blocks * (1.0 - self.admit_reserve)

    def can_prefetch(self, t: ChunkTable, upto: int) -> bool:
        """Admit a prefetch of `t` as a turn, but only into blocks that are free or held by
        idle chunks of conversations nobody is typing in: a prefetch is a guess, so it never
        undoes another one, nor the context that an expected turn will look for."""
        if not self.can_admit(t, upto):
            return False
        need = self.blocks_needed(t, upto)
        spare = self.gpu.num_free
        for x in self._candidates():
            if spare >= need:
                break
            if not self._expected(x):
                spare += self._idle_gpu_blocks(x)
        return spare >= need

    def _expected(self, x: ChunkTable | Chunk) -> bool:
        """Its conversation's (a shared chunk: a holder's) user is typing."""
        holders = x.holders if isinstance(x, Chunk) else (x,)
        return any(self.policy.is_expected(h.id, self._now) for h in holders)  # type: ignore[union-attr]

    def _idle_gpu_blocks(self, x: ChunkTable | Chunk) -> int:
        if isinstance(x, Chunk):
            return int(x.gpu is not None and x.pins == 0)
        return 0 if x.pinned else x.n_gpu

    def loadable(self, t: ChunkTable) -> int:
        """Dropped chunks an admission may take from the disk tier instead of recomputing:
        the whole dropped run, when no shared run follows it (else it is recomputed)."""
        return t.n_dropped if t.n_dropped == t.n_shared else 0

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
            self._let_go(t)
        first, last = loaded or (t.n_dropped, t.n_dropped)
        self._set_pinned(t, True)
        prefetched = 0
        for i, c in enumerate(t.chunks):  # found again on the GPU thanks to a prefetch
            if c.prefetched and c.gpu is not None:
                prefetched += max(0, min(cs, kv_len - i * cs))
            c.prefetched = False
        need = self.blocks_needed(t, upto)
        if not self._make_room_gpu(need, copies, UNEXPECTED if prefetch else None):
            self._set_pinned(t, False)
            raise MemoryError(f"no room on the GPU for {need} blocks")
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
            self._set_gpu(t, chunk)
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

    def grow(self, t: ChunkTable, kv_len: int, upto: int) -> CopyPlan | None:
        """Room for a running turn to compute positions [kv_len, upto): the copies that make
        it, or None if none can be made."""
        copies = CopyPlan()
        need = self.n_chunks(upto) - len(t.chunks)
        if need > 0 and not self._make_room_gpu(need, copies):
            return None
        self._extend(t, upto)
        self._will_write(t, kv_len)
        return copies

    def release(self, t: ChunkTable, kv_len: int) -> None:
        """The turn ended with `kv_len` positions computed: unpin, keep the KV (or drop it
        all in stateless mode)."""
        self._trim(t, kv_len)
        self._set_pinned(t, False)
        if self.mode == "stateless":
            for c in t.chunks:
                self._free_chunk(t, c)
            t.n_dropped = t.n_shared = t.n_off_gpu = len(t.chunks)
        self._changed(t)

    def suspend(self, t: ChunkTable, kv_len: int) -> CopyPlan:
        """Take a running turn's KV off the GPU (to the CPU where it fits) so others can
        decode; returns the swap-outs. Its shared chunks stay where they are, unpinned."""
        copies = CopyPlan()
        self._trim(t, kv_len)
        self._set_pinned(t, False)
        while t.n_off_gpu < len(t.chunks):
            self._evict_front_gpu(t, copies)
        self.counters.suspensions += 1
        self._changed(t)
        return copies

    def drop_prefix(self, t: ChunkTable, tokens: int) -> None:
        """Positions [0, tokens) hold no valid KV (a recompute stopped half way): drop them."""
        k = min(self.n_chunks(tokens), len(t.chunks))
        if k > t.n_dropped:
            self._let_go(t)
        for c in t.chunks[:k]:
            self._free_chunk(t, c)
        t.n_dropped = max(t.n_dropped, k)
        t.n_shared = max(t.n_shared, k)
        t.n_off_gpu = max(t.n_off_gpu, k)
        self._changed(t)

    def truncate(self, t: ChunkTable, length: int) -> None:
        """Forget positions from `length` on (the caller's history says the stream is shorter)."""
        if t.pinned:
            raise RuntimeError("cannot truncate a running conversation")
        if length >= t.tokens:
            return
        keep = self.n_chunks(length)
        if keep > length // self.chunk_size and keep <= t.n_shared:
            # The cut falls inside a shared chunk, which is never written: recompute instead.
            self._let_go(t)
        for c in t.chunks[keep:]:
            self._free_chunk(t, c)
        del t.chunks[keep:]
        t.tokens = length
        t.n_dropped = min(t.n_dropped, keep)
        t.n_shared = min(t.n_shared, keep)
        t.n_off_gpu = min(t.n_off_gpu, keep)
        self._changed(t)

    # ---- prefetch -------------------------------------------------------------------------

    def on_cpu(self, t: ChunkTable) -> bool:
        """The idle table holds chunks on the CPU tier only (none dropped): a swap-in
        prefetch can bring them back."""
        if t.pinned or t.n_dropped or self.mode != "pensieve":
            return False
        return t.n_off_gpu > t.n_shared or any(c.gpu is None for c in self._run(t))

    def prefetch(self, t: ChunkTable) -> tuple[CopyPlan, bool]:
        """Copy the idle table's CPU chunks back to the GPU, back of the CPU run first, into
        free blocks or blocks reclaimed at no cost from idle chunks worth less. Returns the
        swap-ins and whether nothing is left to bring back.

        Its turn must be expected (`Policy.expect`): making room then takes none of its own
        chunks (an unexpected table's CPU copies could be dropped, or its shared run let go,
        to make room for its own swap-ins)."""
        copies = CopyPlan()
        if not self._expected(t):
            raise ValueError(f"prefetch of {t.id!r} whose turn is not expected (Policy.expect)")
        if not self.on_cpu(t):
            return copies, True
        for i in range(t.n_off_gpu - 1, t.n_dropped - 1, -1):
            c = t.chunks[i]
            if c.gpu is not None:  # a shared chunk already on the GPU
                continue
            owner = c if c.shared else t
            if not self._reclaim_for(t, self._key(owner, i), copies):
                return copies, False
            self._set_gpu(None if c.shared else t, c)
            c.prefetched = True
            copies.swap_in.append((c.cpu, c.gpu))
            self.counters.prefetched_tokens += self._chunk_tokens(t, i)
            if i >= t.n_shared:  # the CPU run ends one chunk earlier: the layout holds
                t.n_off_gpu = i
            self._changed(c if c.shared else t)
        return copies, True

    def _reclaim_for(self, t: ChunkTable, key, copies: CopyPlan) -> bool:
        """A free GPU block for a prefetch of `t`: free already, or the GPU block of the
        lowest-value idle chunk if it is worth less than `key` (reclaimed at no cost when it
        has a CPU copy, else evicted as an admission would). Never a running turn's block
        (pinned chunks are no candidates), nor one of another expected conversation."""
        if self.gpu.num_free:
            return True
        self._gpu_heap.ensure(self._candidates())
        found = self._evicting(self._gpu_heap.pop())
        if found is None:
            return False
        x, i = found
        if x is t or self._expected(x) or self._key(x, i) >= key:
            return False
        if isinstance(x, Chunk):
            self._evict_shared_gpu(x, copies, UNEXPECTED)
        else:
            self._evict_front_gpu(x, copies, UNEXPECTED)
        return self.gpu.num_free > 0

    # ---- ahead-of-time swap-out -----------------------------------------------------------

    def swap_out_ahead(self, busy: bool = False) -> CopyPlan:
        """When free GPU blocks fall under the threshold, copy the lowest-value chunks to the
        CPU in the background, keeping their GPU blocks until they are reallocated.
        Does nothing while a swap-in is in flight (`busy`): swap-in has priority."""
        copies = CopyPlan()
        if busy or self.cpu.num_blocks == 0:
            return copies
        want = int(self.swap_out_threshold * self.gpu.num_blocks)
        short = want - self.gpu.num_free - self._reclaimable
        if short <= 0:
            return copies
        self._unbacked_heap.ensure(self._candidates())
        while len(copies.background) < short:
            found = self._evicting(self._unbacked_heap.pop())
            if found is None:
                break
            t, i = found
            block = self._alloc_cpu(max_key=self._key(t, i))
            if block is None:
                break
            chunk = self._chunk(t, i)
            if chunk.gpu is None or chunk.cpu is not None:  # let go while making room
                self.cpu.release(block)
                continue
            self._set_cpu(t, chunk, block)
            self._cpu_heap.push(t)  # the copy may now be its cheapest CPU block
            copies.background.append((chunk.gpu, block))
            self.counters.swapped_out_tokens += self._chunk_tokens(t, i)
        return copies

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

    def sharing(self) -> tuple[int, int]:
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
        """Assert the invariants: layout, one owner per block, nothing leaked, counts right,
        shared chunks held by exactly the tables that list them."""
        owners: dict[tuple[str, int], str] = {}

        def own(c: Chunk, who: str) -> None:
            for tier, b, pool in (("gpu", c.gpu, self.gpu), ("cpu", c.cpu, self.cpu)):
                if b is None:
                    continue
                assert (tier, b) not in owners, f"{tier} block {b} owned twice"
                assert not pool.is_free(b), f"{tier} block {b} is owned and free"
                owners[(tier, b)] = who

        pinned_gpu = reclaimable = 0
        held: dict[Chunk, list[ChunkTable]] = {}
        for t in self.tables.values():
            assert 0 <= t.n_dropped <= t.n_shared <= t.n_off_gpu <= len(t.chunks), t
            assert len(t.chunks) >= self.n_chunks(t.tokens) or t.pinned, t
            full = t.n_shared == t.n_dropped or t.n_shared * self.chunk_size <= t.tokens
            assert full, (t.id, "a shared chunk that is not full")
            for i, c in enumerate(t.chunks):
                if t.n_dropped <= i < t.n_shared:
                    assert c.shared and c.index == i, (t.id, i, "should be shared")
                    assert c.gpu is not None or c.cpu is not None, (t.id, i, "shared, empty")
                    assert c.gpu is not None or not t.pinned, (t.id, i, "running, off GPU")
                    held.setdefault(c, []).append(t)
                    continue
                assert not c.shared, (t.id, i, "shared outside the shared run")
                if i < t.n_dropped:
                    assert c.gpu is None and c.cpu is None, (t.id, i, "should be dropped")
                elif i < t.n_off_gpu:
                    assert c.gpu is None and c.cpu is not None, (t.id, i, "should be on CPU")
                else:
                    assert c.gpu is not None, (t.id, i, "should be on GPU")
                own(c, t.id)
            n_gpu = len(t.chunks) - t.n_off_gpu
            n_backed = sum(1 for c in t.chunks[t.n_off_gpu :] if c.cpu is not None)
            assert (t.n_gpu, t.n_backed) == (n_gpu, n_backed), (t.id, "counts drifted")
            pinned_gpu += n_gpu if t.pinned else 0
            reclaimable += 0 if t.pinned else n_backed
        assert set(held) == set(self.shared), "shared chunks held and registered differ"
        for c, ts in held.items():
            assert c.holders is not None and set(c.holders) == set(ts), "holders drifted"
            assert len(c.holders) == len(ts), "a holder lists it twice"
            assert c.key is None or self.index.get(c.key) is c, "stale key"
            assert c.pins == sum(1 for t in ts if t.pinned), "pins drifted"
            if c.parent is None:  # the first chunk each holder holds
                assert all(t.n_dropped == c.index for t in ts), (c.index, "parent")
            else:
                assert all(t.chunks[c.index - 1] is c.parent for t in ts), (c.index, "chain")
            own(c, "shared")
            if c.gpu is not None:
                pinned_gpu += 1 if c.pins else 0
                reclaimable += 1 if not c.pins and c.cpu is not None else 0
        for key, c in self.index.items():
            assert c.key == key and c in self.shared, "index entry of a dead chunk"
        assert (self._pinned_gpu, self._reclaimable) == (pinned_gpu, reclaimable), "counts"
        for tier, pool in (("gpu", self.gpu), ("cpu", self.cpu)):
            owned = sum(1 for t, _ in owners if t == tier)
            stale = len(self._stale) if tier == "cpu" else 0
            assert owned + pool.num_free + stale == pool.num_blocks, f"{tier} blocks leaked"

    # ---- internals: every change of a chunk goes through these, keeping the counts ---------

    def _run(self, t: ChunkTable) -> list[Chunk]:
        return t.chunks[t.n_dropped : t.n_shared]

    def _set_pinned(self, t: ChunkTable, pinned: bool) -> None:
        if t.pinned == pinned:
            return
        sign = 1 if pinned else -1
        self._pinned_gpu += sign * t.n_gpu
        self._reclaimable -= sign * t.n_backed
        t.pinned = pinned
        for c in self._run(t):
            self._pin_shared(c, sign)
        if not pinned:
            self._changed(t)  # a candidate again

    def _pin_shared(self, c: Chunk, sign: int) -> None:
        before = c.pins > 0
        c.pins += sign
        if before != (c.pins > 0) and c.gpu is not None:
            flip = 1 if c.pins else -1  # counted as pinned now, or no longer
            self._pinned_gpu += flip
            self._reclaimable -= flip * (c.cpu is not None)
        if before and not c.pins:
            self._changed(c)  # a candidate again

    def _account(self, t: ChunkTable, c: Chunk, sign: int) -> None:
        """Add (1) or take away (-1) the chunk's blocks from the counts it belongs to."""
        if c.gpu is not None:
            self._count(t, c, sign, sign * (c.cpu is not None))

    def _count(self, t: ChunkTable | None, c: Chunk, gpu: int, backed: int) -> None:
        if c.shared:  # counted once, whoever holds it
            pinned = c.pins > 0
        else:
            assert t is not None
            t.n_gpu += gpu
            t.n_backed += backed
            pinned = t.pinned
        if pinned:
            self._pinned_gpu += gpu
        else:
            self._reclaimable += backed

    def _set_gpu(self, t: ChunkTable | None, c: Chunk) -> None:
        c.gpu = self.gpu.allocate()
        self._count(t, c, 1, c.cpu is not None)

    def _clear_gpu(self, t: ChunkTable | None, c: Chunk) -> None:
        self.gpu.release(c.gpu)
        c.gpu = None
        c.prefetched = False
        self._count(t, c, -1, -(c.cpu is not None))

    def _set_cpu(self, t: ChunkTable | None, c: Chunk, block: int) -> None:
        c.cpu = block
        self._count(t, c, 0, c.gpu is not None)

    def _clear_cpu(self, t: ChunkTable | None, c: Chunk, stale: bool = False) -> None:
        if stale:
            self._stale.append(c.cpu)
        else:
            self.cpu.release(c.cpu)
        c.cpu = None
        self._count(t, c, 0, -(c.gpu is not None))

    def _spill(self, t: ChunkTable, i: int, c: Chunk) -> None:
        """Chunk `c` (at index `i` of `t`) loses its last copy in memory: with a disk tier,
        the engine copies it out of its block before the block is used again and queues it
        to be written (`take_spills`). Only full chunks: a file is keyed by its tokens."""
        if not self.spilling or (i + 1) * self.chunk_size > t.tokens:
            return
        if c.gpu is not None:
            self.spills.append((t.id, i, "gpu", c.gpu))
        elif c.cpu in self._incoming:  # its swap-out has not run yet: the GPU block holds it
            self.spills.append((t.id, i, "gpu", self._incoming[c.cpu]))
        elif c.cpu is not None:
            self.spills.append((t.id, i, "cpu", c.cpu))
        else:
            return
        self.counters.spilled_tokens += self.chunk_size

    def take_spills(self) -> list[tuple[str, int, str, int]]:
        """(conversation, chunk index, tier, block) of every chunk dropped since the last
        call, whose block still holds its KV until this step's copies run."""
        out, self.spills = self.spills, []
        return out

    def _free_chunk(self, t: ChunkTable | None, c: Chunk) -> None:
        """Free a private chunk's blocks; a shared one loses `t` as a holder."""
        if c.shared:
            assert t is not None
            self._unref(t, c)
            return
        if c.gpu is not None:
            self._clear_gpu(t, c)
        if c.cpu is not None:
            self._clear_cpu(t, c)

    def _changed(self, t: ChunkTable | Chunk) -> None:
        """The item's front candidates may have got cheaper: let the heaps see it again."""
        for heap in self._heaps:
            heap.push(t)

    def _candidates(self) -> Iterable[ChunkTable | Chunk]:
        return itertools.chain(self.tables.values(), self.shared)

    def _chunk(self, t: ChunkTable | Chunk, i: int) -> Chunk:
        return t if isinstance(t, Chunk) else t.chunks[i]

    def _evicting(self, found: tuple[ChunkTable | Chunk, int] | None):
        """A heap's pick, noting how recently active it was (see REORDER_SHARE)."""
        if found is not None:
            t = found[0]
            holders = t.holders if isinstance(t, Chunk) else (t,)
            last = max(self.policy.last_active(h, self._key_now) for h in holders)  # type: ignore[union-attr]
            idle = max(0.0, self._key_now - last)
            self._frontier_idle = (
                idle if self._frontier_idle is None else min(self._frontier_idle, idle)
            )
        return found

    def _key(self, t: ChunkTable | Chunk, i: int):
        if isinstance(t, Chunk):
            return self.policy.shared_key(t.holders, t.index, self._key_now)
        return self.policy.key(t, i, self._key_now)

    def _chunk_tokens(self, t: ChunkTable | Chunk, i: int) -> int:
        if isinstance(t, Chunk):
            return self.chunk_size
        return max(0, min(self.chunk_size, t.tokens - i * self.chunk_size))

    def _trim(self, t: ChunkTable, kv_len: int) -> None:
        """Keep the chunks of positions [0, kv_len): the rest were allocated but not written."""
        t.tokens = kv_len
        keep = self.n_chunks(kv_len)
        for c in t.chunks[keep:]:
            self._free_chunk(t, c)
        del t.chunks[keep:]

    def _extend(self, t: ChunkTable, upto: int) -> None:
        while len(t.chunks) < self.n_chunks(upto):
            chunk = Chunk()
            t.chunks.append(chunk)
            self._set_gpu(t, chunk)

    def _will_write(self, t: ChunkTable, start: int) -> None:
        """Positions from `start` on are about to be written: a CPU copy of their chunk goes stale."""
        i = start // self.chunk_size
        if i < len(t.chunks) and t.chunks[i].cpu is not None and t.chunks[i].gpu is not None:
            assert not t.chunks[i].shared, "a shared chunk is never written"
            # It may be the source of this step's swap-in: freed only at the next step.
            self._clear_cpu(t, t.chunks[i], stale=True)

    # Front candidates: the chunk a table gives up next in each tier (None: nothing). A shared
    # chunk (no holder running) is its own candidate: index 0 stands for itself.
    def _gpu_front(self, t: ChunkTable | Chunk) -> int | None:
        if isinstance(t, Chunk):
            return 0 if t.pins == 0 and t.gpu is not None else None
        if t.pinned or t.n_off_gpu >= len(t.chunks):
            return None
        return t.n_off_gpu

    def _unbacked_gpu_front(self, t: ChunkTable | Chunk) -> int | None:
        if isinstance(t, Chunk):
            return 0 if t.pins == 0 and t.gpu is not None and t.cpu is None else None
        if t.pinned or t.n_backed == t.n_gpu:
            return None
        for i in range(t.n_off_gpu, len(t.chunks)):
            if t.chunks[i].cpu is None:
                return i
        return None

    def _cpu_front(self, t: ChunkTable | Chunk) -> int | None:
        if isinstance(t, Chunk):  # a CPU-only one only as the first chunk its holders hold
            ok = t.pins == 0 and t.cpu is not None and (t.gpu is not None or t.parent is None)
            return 0 if ok else None
        if t.pinned:
            return None
        if t.n_shared < t.n_off_gpu:
            return t.n_shared
        if t.n_backed == 0:
            return None
        for i in range(t.n_off_gpu, len(t.chunks)):
            if t.chunks[i].cpu is not None:
                return i
        return None

    def _make_room_gpu(self, n: int, copies: CopyPlan, cpu_below=None) -> bool:
        if self.gpu.num_free >= n:
            return True
        self._gpu_heap.ensure(self._candidates())
        while self.gpu.num_free < n:
            found = self._evicting(self._gpu_heap.pop())
            if found is None:
                return False
            if isinstance(found[0], Chunk):
                self._evict_shared_gpu(found[0], copies, cpu_below)
            else:
                self._evict_front_gpu(found[0], copies, cpu_below)
        return True

    def _evict_front_gpu(self, t: ChunkTable, copies: CopyPlan, cpu_below=None) -> None:
        """Free the GPU block of the table's first GPU chunk: reclaim it if it has a CPU
        copy, else swap it out (into a CPU block of a chunk worth less than `cpu_below`, when
        given), else drop it (with the chunks before it)."""
        i = t.n_off_gpu
        chunk = t.chunks[i]
        if chunk.cpu is None and self.cpu.num_blocks:
            block = self._alloc_cpu(max_key=cpu_below)
            if block is not None:
                self._set_cpu(t, chunk, block)
                copies.swap_out.append((chunk.gpu, block))
                self._incoming[block] = chunk.gpu
                self.counters.swapped_out_tokens += self._chunk_tokens(t, i)
        if chunk.cpu is None:
            self._spill(t, i, chunk)
        self._clear_gpu(t, chunk)
        t.n_off_gpu = i + 1
        if chunk.cpu is None:  # dropped: keep the layout by dropping what is before
            self._let_go(t, spill=True)
            for j in range(t.n_dropped, i + 1):
                self.counters.dropped_tokens += self._chunk_tokens(t, j)
                self._spill(t, j, t.chunks[j])
                self._free_chunk(t, t.chunks[j])
            t.n_dropped = t.n_shared = i + 1
        else:
            self._cpu_heap.push(t)  # a new CPU-only chunk: maybe its cheapest CPU block

    def _evict_shared_gpu(self, c: Chunk, copies: CopyPlan, cpu_below=None) -> None:
        """Free a shared chunk's GPU block: reclaim, swap out, or drop it."""
        if c.cpu is None and self.cpu.num_blocks:
            block = self._alloc_cpu(max_key=cpu_below)
            if c not in self.shared or c.gpu is None:  # freed while the CPU made room
                if block is not None:
                    self.cpu.release(block)
                return
            if block is not None:
                self._set_cpu(None, c, block)
                copies.swap_out.append((c.gpu, block))
                self._incoming[block] = c.gpu
                self.counters.swapped_out_tokens += self.chunk_size
        if c.cpu is None:
            self._drop_shared(c)
            return
        self._clear_gpu(None, c)
        self._cpu_heap.push(c)

    def _alloc_cpu(self, max_key=None) -> int | None:
        """A CPU block, dropping the lowest-value CPU chunks if the pool is full (only those
        whose key is below `max_key`, when given)."""
        if self.cpu.num_free:
            return self.cpu.allocate()
        self._cpu_heap.ensure(self._candidates())
        found = self._evicting(self._cpu_heap.pop())
        if found is None:
            return None
        t, i = found
        if max_key is not None and self._key(t, i) >= max_key:
            return None
        if isinstance(t, Chunk):
            if t.gpu is None:  # a CPU-only shared chunk: it is dropped
                self._drop_shared(t)
            else:  # it loses its copy: it must be copied again before it is reclaimed
                self._clear_cpu(None, t)
                self._unbacked_heap.push(t)
            return self.cpu.allocate()
        chunk = t.chunks[i]
        if i < t.n_off_gpu:  # a CPU-only chunk: it is dropped (with the shared run before it)
            self._let_go(t, spill=True)
            self._spill(t, i, chunk)
            self.counters.dropped_tokens += self._chunk_tokens(t, i)
            t.n_dropped = t.n_shared = i + 1
        else:  # a GPU chunk loses its copy: it must be copied again before it is reclaimed
            self._unbacked_heap.push(t)
        self._clear_cpu(t, chunk)
        return self.cpu.allocate()
