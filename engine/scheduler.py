"""Unified scheduling: no prefill or decode phases, only tokens still to compute.

Each step takes the running turns' tokens first-come first-served up to the token budget
(a decode is one token, a long prompt may be split over steps), then admits waiting turns
while the cache keeps room for decoding. When decoding runs out of GPU blocks, the
latest-arrived running turns are suspended: their KV leaves the GPU and they wait again.

A step is a value: `schedule` returns a `StepPlan` with everything the engine must carry
out (the batch, the copies before and after the forward, the turns that must end).
Reading history is I/O and may fail: that is a status of one turn, never an exception.

Prefetch (a user is typing in an idle conversation) is the lowest priority: its swap-ins go
in the step's copies and its recomputes run as internal turns that sample nothing. New ones
start only when no turn waits for admission (and, with no `prefetch_share`, no real turn
runs); running ones get what real turns leave of the budget (at most `prefetch_share` of
it while real turns run, never more than `prefetch_step_tokens`), are the first suspended,
give their room up to a waiting turn that cannot be admitted, and end when a real turn of
their conversation comes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.cache import KVCacheManager
from engine.conversation import ChunkTable
from engine.copies import CopyPlan
from engine.request import FINISHED, RUNNING, WAITING, Request

# What a history read of a waiting turn says (see `Scheduler.fetch`).
READY, PENDING, FAILED = "ready", "pending", "failed"
PREFETCH_WAIT_S = 15.0  # a prefetch that found no room by then is given up


@dataclass
class Piece:
    """One sub-request of a step: positions [start, end) of a turn's conversation."""

    req: Request
    start: int
    end: int
    sample: bool  # its last position is the last known token: sample the next one


@dataclass(frozen=True)
class StepPlan:
    pieces: list[Piece] = field(default_factory=list)
    before: CopyPlan = field(default_factory=CopyPlan)  # swap-outs, swap-ins: with the forward
    after: CopyPlan = field(default_factory=CopyPlan)  # ahead-of-time copies: after it
    full: list[Request] = field(default_factory=list)  # filled the whole GPU tier: end "length"
    failed: list[Request] = field(default_factory=list)  # history read failed: end "error"


class Scheduler:
    def __init__(
        self,
        cache: KVCacheManager,
        max_batch_tokens: int,
        max_running: int,
        unified: bool = True,
        fetch: Callable[[Request, int], str] | None = None,
        prefetch_share: float = 0.25,
        prefetch_step_tokens: int | None = None,
    ) -> None:
        self.cache = cache
        self.max_batch_tokens = max_batch_tokens
        self.prefetch_share = prefetch_share
        self.prefetch_step_tokens = prefetch_step_tokens or max_batch_tokens
        self.max_running = max_running
        self.unified = unified
        # fetch(req, n): READY once req.prefix holds history [0, n); PENDING while it is
        # being read; FAILED if the read failed (req.error says why).
        self.fetch = fetch or (
            lambda req, n: READY if req.prefix is not None and len(req.prefix) >= n else PENDING
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefetching: deque[Request] = deque()  # recompute prefetches not admitted yet
        # tables to swap in ahead of a turn, and until when to keep trying
        self.swap_prefetch: dict[ChunkTable, float] = {}

    def add(self, req: Request) -> None:
        req.status = WAITING
        self.waiting.append(req)

    def add_prefetch(self, req: Request) -> None:
        req.status = WAITING
        self.prefetching.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefetching or self.swap_prefetch)

    # ---- planning a step ---------------------------------------------------------------------

    def schedule(self, swap_in_busy: bool = False) -> StepPlan:
        """Plan one step. `swap_in_busy`: an earlier swap-in is still being copied, so no
        ahead-of-time swap-out is started (swap-in has priority)."""
        self.cache.begin_step()
        plan = StepPlan()
        budget = self.max_batch_tokens
        prefill_step = self.unified or self._wants_prefill()
        # Real turns first: those running, then those waiting; prefetches get what is left.
        budget = self._continue(
            [r for r in self.running if not r.prefetch], budget, plan, prefill_step
        )
        if prefill_step:
            budget = self._admit(budget, plan)
        budget = self._continue([r for r in self.running if r.prefetch], budget, plan, prefill_step)
        if prefill_step and not self.waiting and (self._idle() or self.prefetch_share > 0):
            budget = self._admit(budget, plan, prefetch=True)
            self._swap_prefetch(plan)
        plan.after.extend(self.cache.swap_out_ahead(busy=swap_in_busy))
        return plan

    def _continue(self, reqs: list[Request], budget: int, plan: StepPlan, prefill: bool) -> int:
        """Schedule running turns' pending tokens, the earliest-arrived first."""
        for req in sorted(reqs, key=lambda r: r.seq):
            if budget <= 0:
                break
            if req.status != RUNNING:  # suspended earlier in this step
                continue
            if not self.unified and req.in_prefill != prefill:
                continue
            budget -= self._take(req, self._prefetch_budget(req, budget), plan)
        return budget

    def _wants_prefill(self) -> bool:
        if any(r.in_prefill for r in self.running):
            return True
        return (
            bool(self.waiting)
            and len(self.running) < self.max_running
            and self._can_admit(self.waiting[0])
        )

    def _idle(self) -> bool:
        """No real turn runs: only prefetches, if anything."""
        return all(r.prefetch for r in self.running)

    def _prefetch_budget(self, req: Request, budget: int) -> int:
        """A prefetch takes at most `prefetch_share` of the step's tokens while real turns
        run, so that their decode steps stay short, and `prefetch_step_tokens` in any step."""
        if not req.prefetch:
            return budget
        budget = min(budget, self.prefetch_step_tokens)
        if self._idle():
            return budget
        if self.prefetch_share <= 0:
            return 0
        share = int(self.max_batch_tokens * self.prefetch_share)
        return min(budget, max(self.cache.chunk_size, share))

    def _take(self, req: Request, budget: int, plan: StepPlan) -> int:
        """Schedule up to `budget` of a running turn's pending tokens; returns how many."""
        taken = 0
        while req.pending and taken < budget:
            start, end = req.pending[0]
            stop = min(end, start + budget - taken)
            if not self._room(req, stop, plan):
                break
            sample = stop == req.total and not req.prefetch
            plan.pieces.append(Piece(req, start, stop, sample=sample))
            taken += stop - start
            if stop < end:
                req.pending[0] = (stop, end)
                break
            req.pending.pop(0)
        return taken

    def _room(self, req: Request, upto: int, plan: StepPlan) -> bool:
        """Blocks for positions up to `upto`, suspending the latest-arrived turns if needed."""
        while (copies := self.cache.grow(req.table, req.state.kv_len, upto)) is None:
            alive = [r for r in self.running if r.status == RUNNING]
            if alive == [req]:  # it alone fills the GPU tier: it cannot grow any further
                plan.full.append(req)
                return False
            victim = max(alive, key=lambda r: (r.prefetch, r.seq))
            self._suspend(victim, plan)
            if victim is req:
                return False
        plan.before.extend(copies)
        return True

    def _discard_partial_recompute(self, req: Request) -> None:
        """A recompute of dropped chunks that has not finished leaves invalid KV behind."""
        if req.pending and req.pending[0][0] < req.state.kv_len:
            self.cache.drop_prefix(req.table, req.pending[0][1])
            req.pending.pop(0)

    def _suspend(self, req: Request, plan: StepPlan) -> None:
        if req.prefetch:  # a prefetch is not worth a swap-out: it just ends, all of it undone
            plan.pieces[:] = [p for p in plan.pieces if p.req is not req]
            n = req.stats.recomputed_tokens
            req.pending = [(0, n)] if n else []
            self.finish(req, "suspended")
            return
        self._discard_partial_recompute(req)
        plan.before.extend(self.cache.suspend(req.table, req.state.kv_len))
        self.running.remove(req)
        req.status = WAITING
        req.stats.suspensions += 1
        self.waiting.appendleft(req)

    def _dropped_tokens(self, req: Request) -> int:
        return self.cache.recompute_tokens(req.table, req.state.kv_len)

    def _can_admit(self, req: Request) -> bool:
        if req.prefetch:
            return self.cache.can_prefetch(req.table, req.total)
        return self.cache.can_admit(req.table, req.total)

    def _admit(self, budget: int, plan: StepPlan, prefetch: bool = False) -> int:
        """Admit waiting turns in order while the cache has room for each one's context.
        `prefetch`: admit recompute prefetches instead, the same way (making room evicts
        idle chunks by value, as for a turn: the typing conversation is worth the most); one
        that waited longer than PREFETCH_WAIT_S is given up."""
        queue = self.prefetching if prefetch else self.waiting
        skipped: list[Request] = []
        try:
            while queue and budget > 0 and len(self.running) < self.max_running:
                req = queue[0]
                status = self.fetch(req, req.prefix_needed(self._dropped_tokens(req)))
                if status == PENDING:
                    skipped.append(queue.popleft())  # its history is still being read
                    continue
                if status == FAILED:
                    if prefetch:  # the real turn will read (and report) it again
                        self.finish(req, "error")
                    else:
                        plan.failed.append(queue.popleft())
                    continue
                if prefetch and time.time() - req.stats.arrival_s > PREFETCH_WAIT_S:
                    self.finish(req, "expired")  # the moment passed
                    continue
                if not self._can_admit(req):
                    if not prefetch and self._yield_prefetch(plan):
                        continue  # a running prefetch gave its room back: look again
                    break
                queue.popleft()
                self._start(req, plan)
                budget -= self._take(req, self._prefetch_budget(req, budget), plan)
        finally:  # whatever happens, a turn whose history is being read stays queued
            queue.extendleft(reversed(skipped))
        return budget

    def _yield_prefetch(self, plan: StepPlan) -> bool:
        """End the latest running prefetch, if any, so that its context no longer holds the
        GPU tier's room that a waiting real turn needs."""
        prefetches = [r for r in self.running if r.prefetch and r.status == RUNNING]
        if not prefetches:
            return False
        self._suspend(max(prefetches, key=lambda r: r.seq), plan)
        return True

    def _start(self, req: Request, plan: StepPlan) -> None:
        """Bring an admitted turn's context to the GPU tier and queue what it must compute:
        the dropped prefix, then its own tokens."""
        adm = self.cache.admit(req.table, req.state.kv_len, req.total, prefetch=req.prefetch)
        plan.before.extend(adm.copies)
        if not req.admitted_once:  # a resumed turn keeps the figures of its first admission
            req.admitted_once = True
            req.stats.admitted_s = time.time()
            req.stats.cached_tokens = adm.cached_tokens
            req.stats.swapped_in_tokens = adm.swapped_in_tokens
            req.stats.prefetched_tokens = adm.prefetched_tokens
        req.stats.recomputed_tokens += adm.recompute_tokens
        req.pending = [(0, adm.recompute_tokens)] if adm.recompute_tokens else []
        if req.state.kv_len < req.total:
            req.pending.append((req.state.kv_len, req.total))
        req.status = RUNNING
        self.running.append(req)

    def _swap_prefetch(self, plan: StepPlan) -> None:
        """Swap in the CPU chunks of conversations whose user is typing, where there is room."""
        for table in list(self.swap_prefetch):
            if self.cache.tables.get(table.id) is not table:  # forgotten meanwhile
                del self.swap_prefetch[table]
                continue
            copies, done = self.cache.prefetch(table)
            plan.before.extend(copies)
            if done or time.time() > self.swap_prefetch[table]:
                del self.swap_prefetch[table]

    # ---- after a step ----------------------------------------------------------------------

    def finish(self, req: Request, reason: str) -> None:
        """End a turn (running or waiting): release its pins, keep its KV."""
        if req.status == RUNNING:
            self._discard_partial_recompute(req)
            self.running.remove(req)
            self.cache.release(req.table, req.state.kv_len)
        elif req.status == WAITING and req in self.waiting:
            self.waiting.remove(req)
        elif req.status == WAITING and req in self.prefetching:
            self.prefetching.remove(req)
        req.status = FINISHED
        req.finish_reason = reason
