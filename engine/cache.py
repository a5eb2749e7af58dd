"""KVCacheManager: the chunk tables of all conversations over a GPU and a CPU block pool.

Pure bookkeeping: it decides where every chunk lives and returns the copies that the
KV pool must carry out (`CopyPlan`); it never touches a tensor. It is the only writer of
the chunk tables.

Cost per step: the counts that admission and ahead-of-time swap-out ask for (pinned and
reclaimable blocks) are kept up to date as chunks move, so asking is O(1). Eviction pops
from one lazy heap per candidate kind; as a chunk's value Cost(l) / T depends on the time
of the step, a heap is built at most once per step, on the first eviction of that kind,
and each eviction after that is O(log n).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine.blocks import BlockPool
from engine.conversation import Chunk, ChunkTable
from engine.policy import Policy


@dataclass
class CopyPlan:
    """Copies for a step, carried out in this order:
    swap_out (gpu -> cpu) before the freed GPU blocks are written again, then swap_in
    (cpu -> gpu, pipelined layer by layer with the forward); background (gpu -> cpu, ahead of
    time) after the forward; the GPU blocks stay in use until reclaimed."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    background: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.background)

    def extend(self, other: CopyPlan) -> None:
        self.swap_out += other.swap_out
        self.swap_in += other.swap_in
        self.background += other.background


@dataclass
class Admission:
    cached_tokens: int  # context already on the GPU
    swapped_in_tokens: int  # context coming back from the CPU
    recompute_tokens: int  # leading positions [0, n) to recompute from raw history
    copies: CopyPlan = field(default_factory=CopyPlan)  # swap-outs to make room, swap-ins


@dataclass
class Counters:
    swapped_in_tokens: int = 0
    swapped_out_tokens: int = 0
    recomputed_tokens: int = 0
    cached_tokens: int = 0
    dropped_tokens: int = 0
    suspensions: int = 0


class _LazyHeap:
    """Min-heap over chunk tables by the key of their front candidate chunk. Entries are
    re-checked when popped, so it stays right while chunks move as long as a table whose
    front may have got cheaper is pushed again (`push`). Built on first use; `reset` when
    keys change (a new step)."""

    def __init__(self, front: Callable, key: Callable) -> None:
        self.front, self.key = front, key
        self.heap: list | None = None
        self._n = itertools.count()  # ties: never compare tables

    def reset(self) -> None:
        self.heap = None

    def ensure(self, tables: Iterable[ChunkTable]) -> None:
        if self.heap is None:
            self.heap = []
            for t in tables:
                i = self.front(t)
                if i is not None:
                    self.heap.append((self.key(t, i), next(self._n), t))
            heapq.heapify(self.heap)

    def push(self, t: ChunkTable) -> None:
        if self.heap is not None:
            i = self.front(t)
            if i is not None:
                heapq.heappush(self.heap, (self.key(t, i), next(self._n), t))

    def pop(self) -> tuple[ChunkTable, int] | None:
        heap = self.heap
        while heap:
            k, _, t = heapq.heappop(heap)
            i = self.front(t)
            if i is None:
                continue
            k2 = self.key(t, i)
            heapq.heappush(heap, (k2, next(self._n), t))  # it may have more chunks to give
            if k2 == k:
                return t, i
        return None


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
    ) -> None:
        self.gpu = BlockPool(gpu_blocks)
        self.cpu = BlockPool(cpu_blocks if mode == "pensieve" else 0)
        self.chunk_size = chunk_size
        self.policy = policy
        self.mode = mode
        self.admit_reserve = admit_reserve
        self.swap_out_threshold = swap_out_threshold
        self.now = now
        self.tables: dict[str, ChunkTable] = {}
        self.counters = Counters()
        self._now = now()
        self._stale: list[int] = []  # CPU blocks to free once this step's swap-in has read them
        self._pinned_gpu = 0  # GPU blocks of pinned tables
        self._reclaimable = 0  # GPU blocks of idle tables that have a CPU copy
        # The chunk each table gives up next: its first GPU chunk; its first GPU chunk with
        # no CPU copy (to copy ahead of time); its first chunk holding a CPU block.
        self._gpu_heap = _LazyHeap(self._gpu_front, self._key)
        self._unbacked_heap = _LazyHeap(self._unbacked_gpu_front, self._key)
        self._cpu_heap = _LazyHeap(self._cpu_front, self._key)
        self._heaps = (self._gpu_heap, self._unbacked_heap, self._cpu_heap)

    # ---- steps and tables -------------------------------------------------------------------

    def begin_step(self) -> None:
        """A new step: one time for every eviction decision in it. The previous step's copies
        are queued, so the CPU blocks whose copy went stale can be handed out again."""
        self._now = self.now()
        for heap in self._heaps:
            heap.reset()
        for block in self._stale:
            self.cpu.release(block)
        self._stale = []

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
        t.n_dropped = t.n_off_gpu = 0
        del self.tables[conversation_id]

    def reset(self, t: ChunkTable, tokens: int) -> None:
        """Hold nothing: `tokens` positions, all dropped (known only to the raw history)."""
        for c in t.chunks:
            self._free_chunk(t, c)
        n = self.n_chunks(tokens)
        t.chunks = [Chunk() for _ in range(n)]
        t.n_dropped = t.n_off_gpu = n
        t.tokens = tokens

    def n_chunks(self, tokens: int) -> int:
        return -(-tokens // self.chunk_size)

    # ---- admission and growth of running turns -------------------------------------------

    def blocks_needed(self, t: ChunkTable, upto: int) -> int:
        """GPU blocks a turn must allocate to hold positions [0, upto) on the GPU."""
        return self.n_chunks(upto) - (len(t.chunks) - t.n_off_gpu)

    def pinned_blocks(self) -> int:
        return self._pinned_gpu

    def reclaimable(self) -> int:
        """GPU blocks that can be freed at no cost: chunks of idle turns that have a CPU copy."""
        return self._reclaimable

    def can_admit(self, t: ChunkTable, upto: int) -> bool:
        """Admit while a share `admit_reserve` of the GPU pool stays unpinned for decoding."""
        pinned = self._pinned_gpu
        after = pinned + self.n_chunks(upto)
        if pinned == 0:
            return after <= self.gpu.num_blocks
        return after <= self.gpu.num_blocks * (1.0 - self.admit_reserve)

    def admit(self, t: ChunkTable, kv_len: int, upto: int) -> Admission:
        """Pin the table and give every chunk of [0, upto) a GPU block. `kv_len` positions
        have KV (held or dropped); positions from there on are about to be written."""
        copies = CopyPlan()
        self._set_pinned(t, True)
        cs = self.chunk_size
        need = self.blocks_needed(t, upto)
        if not self._make_room_gpu(need, copies):
            self._set_pinned(t, False)
            raise MemoryError(f"no room on the GPU for {need} blocks")
        t.tokens = kv_len
        cached = max(0, min(kv_len, len(t.chunks) * cs) - t.n_off_gpu * cs)
        swapped = recompute = 0
        for i in range(t.n_off_gpu):
            chunk = t.chunks[i]
            self._set_gpu(t, chunk)
            tokens = min(cs, kv_len - i * cs)
            if chunk.cpu is not None:
                copies.swap_in.append((chunk.cpu, chunk.gpu))
                swapped += tokens
            else:
                recompute += tokens
        # Dropped chunks are a prefix, so recomputing positions [0, recompute) restores them.
        assert recompute == min(t.n_dropped * cs, kv_len)
        t.n_dropped = t.n_off_gpu = 0
        self._extend(t, upto)
        self._will_write(t, kv_len)
        self.counters.cached_tokens += cached
        self.counters.swapped_in_tokens += swapped
        self.counters.recomputed_tokens += recompute
        return Admission(cached, swapped, recompute, copies)

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
            t.n_dropped = t.n_off_gpu = len(t.chunks)
        self._changed(t)

    def suspend(self, t: ChunkTable, kv_len: int) -> CopyPlan:
        """Take a running turn's KV off the GPU (to the CPU where it fits) so others can
        decode; returns the swap-outs."""
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
        for c in t.chunks[:k]:
            self._free_chunk(t, c)
        t.n_dropped = max(t.n_dropped, k)
        t.n_off_gpu = max(t.n_off_gpu, k)
        self._changed(t)

    def truncate(self, t: ChunkTable, length: int) -> None:
        """Forget positions from `length` on (the caller's history says the stream is shorter)."""
        if t.pinned:
            raise RuntimeError("cannot truncate a running conversation")
        if length >= t.tokens:
            return
        keep = self.n_chunks(length)
        for c in t.chunks[keep:]:
            self._free_chunk(t, c)
        del t.chunks[keep:]
        t.tokens = length
        t.n_dropped = min(t.n_dropped, keep)
        t.n_off_gpu = min(t.n_off_gpu, keep)
        self._changed(t)

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
        self._unbacked_heap.ensure(self.tables.values())
        while len(copies.background) < short:
            found = self._unbacked_heap.pop()
            if found is None:
                break
            t, i = found
            block = self._alloc_cpu(max_key=self._key(t, i))
            if block is None:
                break
            chunk = t.chunks[i]
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

    def check(self) -> None:
        """Assert the invariants: layout, one owner per block, nothing leaked, counts right."""
        owners: dict[tuple[str, int], str] = {}
        pinned_gpu = reclaimable = 0
        for t in self.tables.values():
            assert 0 <= t.n_dropped <= t.n_off_gpu <= len(t.chunks), t
            assert len(t.chunks) >= self.n_chunks(t.tokens) or t.pinned, t
            for i, c in enumerate(t.chunks):
                if i < t.n_dropped:
                    assert c.gpu is None and c.cpu is None, (t.id, i, "should be dropped")
                elif i < t.n_off_gpu:
                    assert c.gpu is None and c.cpu is not None, (t.id, i, "should be on CPU")
                else:
                    assert c.gpu is not None, (t.id, i, "should be on GPU")
                for tier, b, pool in (("gpu", c.gpu, self.gpu), ("cpu", c.cpu, self.cpu)):
                    if b is None:
                        continue
                    assert (tier, b) not in owners, f"{tier} block {b} owned twice"
                    assert not pool.is_free(b), f"{tier} block {b} is owned and free"
                    owners[(tier, b)] = t.id
            n_gpu = len(t.chunks) - t.n_off_gpu
            n_backed = sum(1 for c in t.chunks[t.n_off_gpu :] if c.cpu is not None)
            assert (t.n_gpu, t.n_backed) == (n_gpu, n_backed), (t.id, "counts drifted")
            pinned_gpu += n_gpu if t.pinned else 0
            reclaimable += 0 if t.pinned else n_backed
        assert (self._pinned_gpu, self._reclaimable) == (pinned_gpu, reclaimable), "counts"
        for tier, pool in (("gpu", self.gpu), ("cpu", self.cpu)):
            owned = sum(1 for t, _ in owners if t == tier)
            stale = len(self._stale) if tier == "cpu" else 0
            assert owned + pool.num_free + stale == pool.num_blocks, f"{tier} blocks leaked"

    # ---- internals: every change of a chunk goes through these, keeping the counts ---------

    def _set_pinned(self, t: ChunkTable, pinned: bool) -> None:
        if t.pinned == pinned:
            return
        sign = 1 if pinned else -1
        self._pinned_gpu += sign * t.n_gpu
        self._reclaimable -= sign * t.n_backed
        t.pinned = pinned

    def _count(self, t: ChunkTable, gpu: int, backed: int) -> None:
        t.n_gpu += gpu
        t.n_backed += backed
        if t.pinned:
            self._pinned_gpu += gpu
        else:
            self._reclaimable += backed

    def _set_gpu(self, t: ChunkTable, c: Chunk) -> None:
        c.gpu = self.gpu.allocate()
        self._count(t, 1, c.cpu is not None)

    def _clear_gpu(self, t: ChunkTable, c: Chunk) -> None:
        self.gpu.release(c.gpu)
        c.gpu = None
        self._count(t, -1, -(c.cpu is not None))

    def _set_cpu(self, t: ChunkTable, c: Chunk, block: int) -> None:
        c.cpu = block
        self._count(t, 0, c.gpu is not None)

    def _clear_cpu(self, t: ChunkTable, c: Chunk, stale: bool = False) -> None:
        if stale:
            self._stale.append(c.cpu)
        else:
            self.cpu.release(c.cpu)
        c.cpu = None
        self._count(t, 0, -(c.gpu is not None))

    def _free_chunk(self, t: ChunkTable, c: Chunk) -> None:
        if c.gpu is not None:
            self._clear_gpu(t, c)
        if c.cpu is not None:
            self._clear_cpu(t, c)

    def _changed(self, t: ChunkTable) -> None:
        """The table's front candidates may have got cheaper: let the heaps see it again."""
        for heap in self._heaps:
            heap.push(t)

    def _key(self, t: ChunkTable, i: int):
        return self.policy.key(t, i, self._now)

    def _chunk_tokens(self, t: ChunkTable, i: int) -> int:
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
            # It may be the source of this step's swap-in: freed only at the next step.
            self._clear_cpu(t, t.chunks[i], stale=True)

    # Front candidates: the chunk a table gives up next in each tier (None: nothing).
    def _gpu_front(self, t: ChunkTable) -> int | None:
        if t.pinned or t.n_off_gpu >= len(t.chunks):
            return None
        return t.n_off_gpu

    def _unbacked_gpu_front(self, t: ChunkTable) -> int | None:
        if t.pinned or t.n_backed == t.n_gpu:
            return None
        for i in range(t.n_off_gpu, len(t.chunks)):
            if t.chunks[i].cpu is None:
                return i
        return None

    def _cpu_front(self, t: ChunkTable) -> int | None:
        if t.pinned:
            return None
        if t.n_dropped < t.n_off_gpu:
            return t.n_dropped
        if t.n_backed == 0:
            return None
        for i in range(t.n_off_gpu, len(t.chunks)):
            if t.chunks[i].cpu is not None:
                return i
        return None

    def _make_room_gpu(self, n: int, copies: CopyPlan) -> bool:
        if self.gpu.num_free >= n:
            return True
        self._gpu_heap.ensure(self.tables.values())
        while self.gpu.num_free < n:
            found = self._gpu_heap.pop()
            if found is None:
                return False
            self._evict_front_gpu(found[0], copies)
        return True

    def _evict_front_gpu(self, t: ChunkTable, copies: CopyPlan) -> None:
        """Free the GPU block of the table's first GPU chunk: reclaim it if it has a CPU
        copy, else swap it out, else drop it (with the CPU chunks before it)."""
        i = t.n_off_gpu
        chunk = t.chunks[i]
        if chunk.cpu is None and self.cpu.num_blocks:
            block = self._alloc_cpu()
            if block is not None:
                self._set_cpu(t, chunk, block)
                copies.swap_out.append((chunk.gpu, block))
                self.counters.swapped_out_tokens += self._chunk_tokens(t, i)
        self._clear_gpu(t, chunk)
        t.n_off_gpu = i + 1
        if chunk.cpu is None:  # dropped: keep [dropped | CPU | GPU] by dropping what is before
            for j in range(t.n_dropped, i + 1):
                self.counters.dropped_tokens += self._chunk_tokens(t, j)
                self._free_chunk(t, t.chunks[j])
            t.n_dropped = i + 1
        else:
            self._cpu_heap.push(t)  # a new CPU-only chunk: maybe its cheapest CPU block

    def _alloc_cpu(self, max_key=None) -> int | None:
        """A CPU block, dropping the lowest-value CPU chunks if the pool is full (only those
        whose key is below `max_key`, when given)."""
        if self.cpu.num_free:
            return self.cpu.allocate()
        self._cpu_heap.ensure(self.tables.values())
        found = self._cpu_heap.pop()
        if found is None:
            return None
        t, i = found
        if max_key is not None and self._key(t, i) >= max_key:
            return None
        chunk = t.chunks[i]
        if i < t.n_off_gpu:  # a CPU-only chunk: it is dropped
            self.counters.dropped_tokens += self._chunk_tokens(t, i)
            t.n_dropped = i + 1
        else:  # a GPU chunk loses its copy: it must be copied again before it is reclaimed
            self._unbacked_heap.push(t)
        self._clear_cpu(t, chunk)
        return self.cpu.allocate()
