"""KVCacheManager: the chunk tables of all conversations over a GPU and a CPU block pool.

Pure bookkeeping: it decides where every chunk lives and records the copies that the
KV pool must carry out (`CopyPlan`); it never touches a tensor.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.blocks import BlockPool
from engine.conversation import Chunk, Conversation
from engine.policy import Policy


@dataclass
class CopyPlan:
    """Copies for the next step, carried out in this order:
    swap_out (gpu -> cpu) before the freed GPU blocks are written again, then swap_in
    (cpu -> gpu, pipelined layer by layer with the forward); background (gpu -> cpu, ahead of
    time) after the forward; the GPU blocks stay in use until reclaimed."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    background: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.background)


@dataclass
class Admission:
    cached_tokens: int  # context already on the GPU
    swapped_in_tokens: int  # context coming back from the CPU
    recompute_tokens: int  # leading positions [0, n) to recompute from raw history


@dataclass
class Counters:
    swapped_in_tokens: int = 0
    swapped_out_tokens: int = 0
    recomputed_tokens: int = 0
    cached_tokens: int = 0
    dropped_tokens: int = 0
    suspensions: int = 0


class _Queue:
    """Lazy min-heap over conversations by the key of their front candidate chunk.
    Entries are re-checked when popped, so it stays right while chunks move."""

    def __init__(self, convs, front: Callable, key: Callable) -> None:
        self.front, self.key = front, key
        self.heap = []
        for n, conv in enumerate(convs):
            i = front(conv)
            if i is not None:
                self.heap.append((key(conv, i), n, conv))
        heapq.heapify(self.heap)

    def pop(self) -> tuple[Conversation, int] | None:
        while self.heap:
            k, n, conv = heapq.heappop(self.heap)
            i = self.front(conv)
            if i is None:
                continue
            k2 = self.key(conv, i)
            if k2 != k:
                heapq.heappush(self.heap, (k2, n, conv))
                continue
            heapq.heappush(self.heap, (k2, n, conv))  # it may have more chunks to give
            return conv, i
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
        self.convs: dict[str, Conversation] = {}
        self.plan = CopyPlan()
        self.counters = Counters()
        self._now = 0.0
        self._stale: list[int] = []  # CPU blocks to free once the current plan is taken

    # ---- conversations ----------------------------------------------------------------

    def get(self, conversation_id: str) -> Conversation:
        conv = self.convs.get(conversation_id)
        if conv is None:
            conv = self.convs[conversation_id] = Conversation(conversation_id)
        return conv

    def forget(self, conversation_id: str) -> None:
        conv = self.convs.pop(conversation_id, None)
        if conv is None:
            return
        if conv.pinned:
            raise RuntimeError(f"conversation {conversation_id!r} is running")
        for c in conv.chunks:
            self._free_chunk(c)
        conv.chunks.clear()

    def reset(self, conv: Conversation, kv_len: int) -> None:
        """Hold nothing: `kv_len` positions, all dropped (known only to the raw history)."""
        for c in conv.chunks:
            self._free_chunk(c)
        n = self.n_chunks(kv_len)
        conv.chunks = [Chunk() for _ in range(n)]
        conv.n_dropped = conv.n_off_gpu = n
        conv.kv_len = kv_len

    def n_chunks(self, tokens: int) -> int:
        return -(-tokens // self.chunk_size)

    # ---- admission and growth of running turns -------------------------------------------

    def blocks_needed(self, conv: Conversation, upto: int) -> int:
        """GPU blocks a turn must allocate to hold positions [0, upto) on the GPU."""
        have = len(conv.chunks) - conv.n_off_gpu
        return self.n_chunks(upto) - have

    def pinned_blocks(self) -> int:
        return sum(len(c.chunks) - c.n_off_gpu for c in self.convs.values() if c.pinned)

    def can_admit(self, conv: Conversation, upto: int) -> bool:
        """Admit while a share `admit_reserve` of the GPU pool stays unpinned for decoding."""
        pinned = self.pinned_blocks()
        after = pinned + self.n_chunks(upto)
        if pinned == 0:
            return after <= self.gpu.num_blocks
        return after <= self.gpu.num_blocks * (1.0 - self.admit_reserve)

    def admit(self, conv: Conversation, upto: int) -> Admission:
        """Pin the conversation and give every chunk of [0, upto) a GPU block."""
        self._begin()
        conv.pinned = True
        cs = self.chunk_size
        need = self.blocks_needed(conv, upto)
        if not self._make_room_gpu(need):
            conv.pinned = False
            raise MemoryError(f"no room on the GPU for {need} blocks")
        cached = max(0, min(conv.kv_len, len(conv.chunks) * cs) - conv.n_off_gpu * cs)
        swapped = recompute = 0
        for i in range(conv.n_off_gpu):
            chunk = conv.chunks[i]
            chunk.gpu = self.gpu.allocate()
            tokens = min(cs, conv.kv_len - i * cs)
            if chunk.cpu is not None:
                self.plan.swap_in.append((chunk.cpu, chunk.gpu))
                swapped += tokens
            else:
                recompute += tokens
        # Dropped chunks are a prefix, so recomputing positions [0, recompute) restores them.
        assert recompute == min(conv.n_dropped * cs, conv.kv_len)
        conv.n_dropped = conv.n_off_gpu = 0
        self._extend(conv, upto)
        self._will_write(conv, conv.kv_len)
        self.counters.cached_tokens += cached
        self.counters.swapped_in_tokens += swapped
        self.counters.recomputed_tokens += recompute
        return Admission(cached, swapped, recompute)

    def grow(self, conv: Conversation, upto: int) -> bool:
        """Room for a running turn to compute positions up to `upto`; False if none can be made."""
        self._begin()
        need = self.n_chunks(upto) - len(conv.chunks)
        if need > 0 and not self._make_room_gpu(need):
            return False
        self._extend(conv, upto)
        self._will_write(conv, conv.kv_len)
        return True

    def release(self, conv: Conversation) -> None:
        """The turn ended: unpin, keep the KV (or drop it all in stateless mode)."""
        conv.pinned = False
        keep = self.n_chunks(conv.kv_len)
        for c in conv.chunks[keep:]:
            self._free_chunk(c)
        del conv.chunks[keep:]
        if self.mode == "stateless":
            for c in conv.chunks:
                self._free_chunk(c)
            conv.n_dropped = conv.n_off_gpu = len(conv.chunks)

    def suspend(self, conv: Conversation) -> None:
        """Take a running turn's KV off the GPU (to the CPU where it fits) so others can decode."""
        self._begin()
        conv.pinned = False
        keep = self.n_chunks(conv.kv_len)
        for c in conv.chunks[keep:]:
            self._free_chunk(c)
        del conv.chunks[keep:]
        while conv.n_off_gpu < len(conv.chunks):
            self._evict_front_gpu(conv)
        self.counters.suspensions += 1

    def truncate(self, conv: Conversation, length: int) -> None:
        """Forget positions from `length` on (the caller's history says the stream is shorter)."""
        if conv.pinned:
            raise RuntimeError("cannot truncate a running conversation")
        if length >= conv.kv_len:
            return
        conv.kv_len = length
        keep = self.n_chunks(length)
        for c in conv.chunks[keep:]:
            self._free_chunk(c)
        del conv.chunks[keep:]
        conv.n_dropped = min(conv.n_dropped, keep)
        conv.n_off_gpu = min(conv.n_off_gpu, keep)

    # ---- ahead-of-time swap-out -----------------------------------------------------------

    def reclaimable(self) -> int:
        """GPU blocks that can be freed at no cost: chunks of idle turns that have a CPU copy."""
        return sum(
            1
            for conv in self.convs.values()
            if not conv.pinned
            for c in conv.chunks[conv.n_off_gpu :]
            if c.cpu is not None
        )

    def swap_out_ahead(self, busy: bool = False) -> int:
        """When free GPU blocks fall under the threshold, copy the lowest-value chunks to the
        CPU in the background, keeping their GPU blocks until they are reallocated.
        Does nothing while a swap-in is in flight (`busy`): swap-in has priority."""
        if busy or self.cpu.num_blocks == 0:
            return 0
        self._begin()
        want = int(self.swap_out_threshold * self.gpu.num_blocks)
        short = want - self.gpu.num_free - self.reclaimable()
        copied = 0
        if short <= 0:
            return 0
        queue = _Queue(self.convs.values(), self._unbacked_gpu_front, self._key)
        while copied < short:
            found = queue.pop()
            if found is None:
                break
            conv, i = found
            block = self._alloc_cpu(max_key=self._key(conv, i))
            if block is None:
                break
            chunk = conv.chunks[i]
            chunk.cpu = block
            self.plan.background.append((chunk.gpu, block))
            self.counters.swapped_out_tokens += self._chunk_tokens(conv, i)
            copied += 1
        return copied

    # ---- inspection -----------------------------------------------------------------------

    def take_plan(self) -> CopyPlan:
        """The copies planned so far. CPU blocks whose copy went stale are freed now: any later
        copy into them is queued after this plan's swap-in has read them."""
        plan, self.plan = self.plan, CopyPlan()
        for block in self._stale:
            self.cpu.release(block)
        self._stale = []
        return plan

    def lowest_value(self, conv: Conversation, now: float) -> float | None:
        """Retention value of the conversation's first chunk still held in a tier."""
        if conv.n_dropped >= len(conv.chunks):
            return None
        return self.policy.value(conv, conv.n_dropped, now)

    def check(self) -> None:
        """Assert the invariants: layout, one owner per block, nothing leaked."""
        owners: dict[tuple[str, int], str] = {}
        for conv in self.convs.values():
            assert 0 <= conv.n_dropped <= conv.n_off_gpu <= len(conv.chunks), conv
            assert len(conv.chunks) >= self.n_chunks(conv.kv_len) or conv.pinned, conv
            for i, c in enumerate(conv.chunks):
                if i < conv.n_dropped:
                    assert c.gpu is None and c.cpu is None, (conv.id, i, "should be dropped")
                elif i < conv.n_off_gpu:
                    assert c.gpu is None and c.cpu is not None, (conv.id, i, "should be on CPU")
                else:
                    assert c.gpu is not None, (conv.id, i, "should be on GPU")
                for tier, b, pool in (("gpu", c.gpu, self.gpu), ("cpu", c.cpu, self.cpu)):
                    if b is None:
                        continue
                    assert (tier, b) not in owners, f"{tier} block {b} owned twice"
                    assert not pool.is_free(b), f"{tier} block {b} is owned and free"
                    owners[(tier, b)] = conv.id
        for tier, pool in (("gpu", self.gpu), ("cpu", self.cpu)):
            owned = sum(1 for t, _ in owners if t == tier)
            stale = len(self._stale) if tier == "cpu" else 0
            assert owned + pool.num_free + stale == pool.num_blocks, f"{tier} blocks leaked"

    # ---- internals ------------------------------------------------------------------------

    def _begin(self) -> None:
        self._now = self.now()

    def _key(self, conv: Conversation, i: int):
        return self.policy.key(conv, i, self._now)

    def _chunk_tokens(self, conv: Conversation, i: int) -> int:
        return max(0, min(self.chunk_size, conv.kv_len - i * self.chunk_size))

    def _free_chunk(self, c: Chunk) -> None:
        if c.gpu is not None:
            self.gpu.release(c.gpu)
            c.gpu = None
        if c.cpu is not None:
            self.cpu.release(c.cpu)
            c.cpu = None

    def _extend(self, conv: Conversation, upto: int) -> None:
        while len(conv.chunks) < self.n_chunks(upto):
            conv.chunks.append(Chunk(gpu=self.gpu.allocate()))

    def _will_write(self, conv: Conversation, start: int) -> None:
        """Positions from `start` on are about to be written: a CPU copy of their chunk goes stale."""
        i = start // self.chunk_size
        if (
            i < len(conv.chunks)
            and conv.chunks[i].cpu is not None
            and conv.chunks[i].gpu is not None
        ):
            # It may be the source of this step's swap-in: free it only once the plan is taken.
            self._stale.append(conv.chunks[i].cpu)
            conv.chunks[i].cpu = None

    # Front candidates: the chunk a conversation gives up next in each tier (None: nothing).
    def _gpu_front(self, conv: Conversation) -> int | None:
        if conv.pinned or conv.n_off_gpu >= len(conv.chunks):
            return None
        return conv.n_off_gpu

    def _unbacked_gpu_front(self, conv: Conversation) -> int | None:
        if conv.pinned:
            return None
        for i in range(conv.n_off_gpu, len(conv.chunks)):
            if conv.chunks[i].cpu is None:
                return i
        return None

    def _cpu_front(self, conv: Conversation) -> int | None:
        if conv.pinned:
            return None
        if conv.n_dropped < conv.n_off_gpu:
            return conv.n_dropped
        for i in range(conv.n_off_gpu, len(conv.chunks)):
            if conv.chunks[i].cpu is not None:
                return i
        return None

    def _make_room_gpu(self, n: int) -> bool:
        if self.gpu.num_free >= n:
            return True
        queue = _Queue(self.convs.values(), self._gpu_front, self._key)
        while self.gpu.num_free < n:
            found = queue.pop()
            if found is None:
                return False
            self._evict_front_gpu(found[0])
        return True

    def _evict_front_gpu(self, conv: Conversation) -> None:
        """Free the GPU block of the conversation's first GPU chunk: reclaim it if it has a
        CPU copy, else swap it out, else drop it (with the CPU chunks before it)."""
        i = conv.n_off_gpu
        chunk = conv.chunks[i]
        if chunk.cpu is None and self.cpu.num_blocks:
            block = self._alloc_cpu()
            if block is not None:
                chunk.cpu = block
                self.plan.swap_out.append((chunk.gpu, block))
                self.counters.swapped_out_tokens += self._chunk_tokens(conv, i)
        self.gpu.release(chunk.gpu)
        chunk.gpu = None
        conv.n_off_gpu = i + 1
        if chunk.cpu is None:  # dropped: keep [dropped | CPU | GPU] by dropping what is before
            for j in range(conv.n_dropped, i + 1):
                self.counters.dropped_tokens += self._chunk_tokens(conv, j)
                self._free_chunk(conv.chunks[j])
            conv.n_dropped = i + 1

    def _alloc_cpu(self, max_key=None) -> int | None:
        """A CPU block, dropping the lowest-value CPU chunks if the pool is full (only those
        whose key is below `max_key`, when given)."""
        if self.cpu.num_free:
            return self.cpu.allocate()
        queue = _Queue(self.convs.values(), self._cpu_front, self._key)
        found = queue.pop()
        if found is None:
            return None
        conv, i = found
        if max_key is not None and self._key(conv, i) >= max_key:
            return None
        chunk = conv.chunks[i]
        if i < conv.n_off_gpu:  # a CPU-only chunk: it is dropped
            self.counters.dropped_tokens += self._chunk_tokens(conv, i)
            conv.n_dropped = i + 1
        self.cpu.release(chunk.cpu)
        chunk.cpu = None
        return self.cpu.allocate()
