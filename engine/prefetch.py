"""Typing-aware prefetch: a user is typing in an idle conversation, so its context is
brought back to the GPU tier before the message comes, at the lowest priority.

One `Prefetcher` per scheduler, which runs it: its CPU chunks are swapped in with a step's
copies (`swap_in`); a dropped prefix is recomputed by an internal turn (`Request.prefetch`:
no tokens of its own, samples nothing) that the scheduler admits and batches like a turn,
within the share of a step that `budget` leaves it. Its real turn ends it (`supersede`), or
takes it over where it is if it runs (`take_over`). The engine only passes the hints on.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from engine.cache.chunks import ChunkTable
from engine.cache.manager import KVCacheManager
from engine.copies import CopyPlan
from engine.request import PrefetchEnd, Request, Status
from engine.stream import StreamState
from engine.types import CacheMode, Turn, TurnStats

WAIT_S = 15.0  # a prefetch that found no room by then is given up


class Prefetcher:
    def __init__(
        self,
        cache: KVCacheManager,
        max_batch_tokens: int,
        share: float,
        step_tokens: int | None,
        now: Callable[[], float] = time.time,
    ) -> None:
        self.cache = cache
        self.max_batch_tokens = max_batch_tokens
        self.share = share  # of a step's tokens while real turns run
        self.step_tokens = step_tokens or max_batch_tokens  # most in any step
        self.now = now  # the engine's clock
        self.queue: deque[Request] = deque()  # recompute prefetches not admitted yet
        self.swaps: dict[ChunkTable, float] = {}  # tables to swap in, and until when to try
        self.current: dict[str, Request] = {}  # each conversation's recompute, until it ends

    def has_work(self) -> bool:
        return bool(self.queue or self.swaps)

    # ---- hints -------------------------------------------------------------------------------

    def hint(self, state: StreamState, seq: int, now: float) -> bool:
        """The user of `state`'s conversation is typing: start bringing its context back (a
        recompute of its dropped prefix as a request of arrival order `seq`, or a swap-in of
        its CPU chunks). Returns whether one started. Nothing starts for an unknown conversation
        (nor a busy one: the engine passes no hint on for it), the baseline cache modes, a context all on the GPU already, or one
        that is being prefetched (typing frames come often: one prefetch at a time)."""
        table = self.cache.tables.get(state.id)
        if self.cache.mode != CacheMode.PENSIEVE or table is None:
            return False
        if table.pinned or state.kv_len == 0:
            return False
        # Its turn is coming: until it does (or a while passes), its chunks are the last
        # idle ones to go, so that running turns do not evict what prefetch brings back.
        self.cache.policy.expect(state.id, now + WAIT_S)
        if state.id in self.current or table in self.swaps:
            return False
        if table.missing:
            req = Request(
                turn=Turn(state.id, []),
                state=state,
                table=table,
                seq=seq,
                base=state.kv_len,
                tokens=[],
                stats=TurnStats(arrival_s=now),
                prefetch=True,
            )
            self.current[state.id] = req
            self.queue.append(req)
            return True
        if self.cache.on_cpu(table):
            self.swaps[table] = now + WAIT_S
            return True
        return False

    def supersede(self, conversation_id: str) -> Request | None:
        """A real turn of the conversation comes (or the conversation is forgotten): its
        swap-in stops and its turn is no longer expected. Returns the recompute in flight,
        if any (the scheduler ends it, or the turn takes it over)."""
        self.cache.policy.unexpect(conversation_id)
        table = self.cache.tables.get(conversation_id)
        if table is not None:
            self.swaps.pop(table, None)
        return self.current.pop(conversation_id, None)

    def take_over(self, prefetch: Request, req: Request) -> None:
        """The real turn `req` goes on from where the running `prefetch` is: it counts what
        the prefetch brought back, and gets its history read; the prefetch ends."""
        done = prefetch.pending[0][0] if prefetch.pending else prefetch.stats.recomputed_tokens
        p, s = prefetch.stats, req.stats
        s.cached_tokens = p.cached_tokens + p.swapped_in_tokens + done
        s.prefetched_tokens = p.swapped_in_tokens + done
        s.recomputed_tokens = p.recomputed_tokens - done
        self.cache.counters.prefetched_tokens += done
        req.prefix, req.fetch = prefetch.prefix, prefetch.fetch
        prefetch.status, prefetch.prefetch_end = Status.FINISHED, PrefetchEnd.SUPERSEDED

    # ---- in the scheduler's steps ----------------------------------------------------------

    def may_start(self, idle: bool) -> bool:
        """New prefetches start when no real turn runs (`idle`), or beside them with a share."""
        return idle or self.share > 0

    def budget(self, budget: int, idle: bool) -> int:
        """A recompute takes at most `share` of the step's tokens while real turns run, so
        that their decode steps stay short, and `step_tokens` in any step."""
        budget = min(budget, self.step_tokens)
        if idle:
            return budget
        if self.share <= 0:
            return 0
        share = int(self.max_batch_tokens * self.share)
        return min(budget, max(self.cache.chunk_size, share))

    def too_late(self, req: Request) -> bool:
        """It waited for room longer than WAIT_S: the moment passed."""
        return self.now() - req.stats.arrival_s > WAIT_S

    def swap_in(self) -> CopyPlan:
        """Swap in the CPU chunks of conversations whose user is typing, where there is room."""
        copies = CopyPlan()
        for table in list(self.swaps):
            if self.cache.tables.get(table.id) is not table:  # forgotten meanwhile
                del self.swaps[table]
                continue
            more, done = self.cache.prefetch(table)
            copies.extend(more)
            if done or self.now() > self.swaps[table]:
                del self.swaps[table]
        return copies

    def end(self, req: Request, why: PrefetchEnd) -> None:
        """A recompute prefetch ends, queued or (released from the batch by the scheduler)
        running."""
        req.prefetch_end = why
        if req.status == Status.WAITING and req in self.queue:
            self.queue.remove(req)
        req.status = Status.FINISHED
        if why is PrefetchEnd.DONE:
            self.cache.counters.prefetched_tokens += req.stats.recomputed_tokens
        if self.current.get(req.state.id) is req:
            del self.current[req.state.id]

    def clear(self) -> None:
        """Forget every prefetch (the scheduler failed all it had)."""
        self.queue.clear()
        self.swaps.clear()
        self.current.clear()
