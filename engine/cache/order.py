"""The eviction order: which chunk each tier gives up next, by the policy's keys.

One lazy heap per candidate kind (a table's first GPU chunk, its first GPU chunk with no
CPU copy, its first chunk holding a CPU block; a shared chunk is a candidate of its own in
each). As a chunk's value Cost(l) / T depends on the time, keys are taken at one time and
a heap is built at most once per such time, on the first eviction of its kind; each
eviction after that is O(log n).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable

from engine.cache.chunks import Chunk, ChunkTable
from engine.cache.policy import Policy

# How long the eviction order is kept. Keys (recompute cost over idle time) are taken at
# one time and the heaps reused, until pins or tools' waits change or the keys are
# older than REORDER_SHARE of the idle time of the most recently active chunk evicted since
# (so no evicted value has drifted by more than that share), at least REORDER_S (while
# nothing has been evicted yet) and at most REORDER_MAX_S. A table whose turn ends in
# between needs no rebuild: its entry is keyed again when popped (a heap re-checks every
# entry it pops), where its activity, after the keys' time, makes it as recent as can be,
# so it goes after every older chunk; a conversation whose turn is queued or ends is
# pushed again (its expectation moved its keys). Rebuilding the heaps at every turn's end,
# or every step, would cost O(conversations) per step of a few milliseconds on a GPU.
REORDER_S = 0.5
REORDER_SHARE = 0.05
REORDER_MAX_S = 10.0

# Keys are (pinned, expected, ...) (see `Policy.key`): a bound on keys below which only
# chunks of conversations nobody is typing in, and nobody pinned, are.
UNEXPECTED = (False, True)

Candidate = ChunkTable | Chunk  # a table, or a shared chunk (index 0 stands for itself)
Found = tuple[Candidate, int] | None


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

    def skip(self, t: ChunkTable) -> None:
        """Leave the item out until it is pushed again."""
        self.latest.pop(id(t), None)

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


# Front candidates: the chunk a table gives up next in each tier (None: nothing). A shared
# chunk (no holder running) is its own candidate: index 0 stands for itself.
def gpu_front(t: Candidate) -> int | None:
    if isinstance(t, Chunk):
        return 0 if t.pins == 0 and t.gpu is not None else None
    if t.pinned or t.n_off_gpu >= len(t.chunks):
        return None
    return t.n_off_gpu


def unbacked_gpu_front(t: Candidate) -> int | None:
    if isinstance(t, Chunk):
        return 0 if t.pins == 0 and t.gpu is not None and t.cpu is None else None
    if t.pinned or t.n_backed == t.n_gpu:
        return None
    for i in range(t.n_off_gpu, len(t.chunks)):
        if t.chunks[i].cpu is None:
            return i
    return None


def cpu_front(t: Candidate) -> int | None:
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


class EvictionOrder:
    """The candidates of every tier in key order, and the times the keys are taken at.
    Reads the tables and shared chunks; every change that may make an item cheaper is
    told to it (`changed`)."""

    def __init__(
        self,
        tables: dict[str, ChunkTable],
        shared: dict[Chunk, None],
        policy: Policy,
        now: Callable[[], float],
        reorder_s: float = REORDER_S,
    ) -> None:
        self.tables, self.shared, self.policy, self.now = tables, shared, policy, now
        self.step_now = now()  # the time of this step's decisions
        self.reorder_s = reorder_s
        self.key_now = self.step_now  # the time the heaps' keys are taken at
        self._key_expected = policy.expectations  # the policy's expectations they were taken with
        self._frontier_idle: float | None = None  # least idle time evicted since, at key_now
        self.gpu = _LazyHeap(gpu_front, self.key)
        self.unbacked = _LazyHeap(unbacked_gpu_front, self.key)
        self.cpu = _LazyHeap(cpu_front, self.key)
        self._heaps = (self.gpu, self.unbacked, self.cpu)

    def begin_step(self) -> None:
        """One time for every decision of the step; the keys are taken again when stale."""
        self.step_now = self.now()
        keep = self.reorder_s
        if self._frontier_idle is not None:
            keep = min(REORDER_MAX_S, max(keep, REORDER_SHARE * self._frontier_idle))
        touched = self.policy.touched()
        if self.step_now - self.key_now >= keep or self._key_expected != self.policy.expectations:
            self.refresh()
            return
        # A turn queued or ended: that conversation's keys alone moved (a rebuild here cost
        # O(conversations) at every such step: most of a busy simulation's time).
        for conversation_id in touched:
            t = self.tables.get(conversation_id)
            if t is not None:
                self.changed(t)
                for c in t.chunks[t.n_dropped : t.n_shared]:
                    if c in self.shared:
                        self.changed(c)

    def refresh(self) -> bool:
        """Take the keys again at this step's time; False if they were taken then already.
        An evictor that meets a pinned chunk calls it: a pin may have expired since the keys
        were taken, and its conversation's chunks sort among the pinned ones until then."""
        if self.key_now == self.step_now and self._key_expected == self.policy.expectations:
            return False
        self.key_now, self._key_expected = self.step_now, self.policy.expectations
        self._frontier_idle = None
        for heap in self._heaps:
            heap.reset()
        return True

    def changed(self, x: Candidate) -> None:
        """The item's front candidates may have got cheaper: let the heaps see it again."""
        for heap in self._heaps:
            heap.push(x)

    def candidates(self) -> Iterable[Candidate]:
        return itertools.chain(self.tables.values(), self.shared)

    def key(self, t: Candidate, i: int):
        if isinstance(t, Chunk):
            return self.policy.shared_key(t.holders, t.index, self.key_now)  # type: ignore[arg-type]
        return self.policy.key(t, i, self.key_now)

    def pinned(self, x: Candidate) -> bool:
        """A client's pin holds its conversation (a shared chunk: a holder's) now. The keys
        may be older: a pin that expired since still sorts as pinned there, but may go."""
        holders = x.holders if isinstance(x, Chunk) else (x,)
        return any(self.policy.pins.held(h.id, self.step_now) for h in holders or ())  # type: ignore[union-attr]

    def expected(self, x: Candidate) -> bool:
        """Its conversation's (a shared chunk: a holder's) user is typing."""
        holders = x.holders if isinstance(x, Chunk) else (x,)
        return any(self.policy.is_expected(h.id, self.step_now) for h in holders)  # type: ignore[union-attr]

    def pop_gpu(self) -> Found:
        """The next GPU chunk to give up."""
        return self._pop(self.gpu)

    def pop_unbacked(self) -> Found:
        """The next GPU chunk with no CPU copy to copy ahead of time."""
        return self._pop(self.unbacked)

    def pop_cpu(self) -> Found:
        """The next CPU block to give up."""
        return self._pop(self.cpu)

    def _pop(self, heap: _LazyHeap) -> Found:
        heap.ensure(self.candidates())
        found = heap.pop()
        if found is not None:  # note how recently active it was (see REORDER_SHARE)
            t = found[0]
            holders = t.holders if isinstance(t, Chunk) else (t,)
            last = max(self.policy.last_active(h, self.key_now) for h in holders)  # type: ignore[union-attr]
            idle = max(0.0, self.key_now - last)
            self._frontier_idle = (
                idle if self._frontier_idle is None else min(self._frontier_idle, idle)
            )
        return found
