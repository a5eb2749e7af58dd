"""Unified scheduling: no prefill or decode phases, only tokens still to compute.

Each step takes the running turns' tokens first-come first-served up to the token budget
(a decode is one token, a long prompt may be split over steps), then admits waiting turns
while the cache keeps room for decoding. When decoding runs out of GPU blocks, the
latest-ranked running turns are suspended: their KV leaves the GPU and they wait again.

Turns wait in the order of their jobs (`Request.rank`): a turn that carries a tool's result
ranks with the turn that began its agent loop, so an agent's steps go ahead of turns that
came after its job began (first come, first served by job, as Continuum schedules agents,
arXiv 2511.02230): a job that has started finishes before later ones take its room, rather
than every live agent slowing down together. Any other turn ranks by its arrival, so a turn
is passed only by the steps of jobs begun before it came: none waits forever.

A step is a value: `schedule` returns a `StepPlan` with everything the engine must carry
out (the batch, the copies before and after the forward, the turns that must end, the
history reads to start). The scheduler never calls the engine: reading history is the
engine's I/O (`engine/reads.py`), whose outcome it finds on each turn (its prefix, or the
error that fails that turn alone: a status, never an exception).

Prefetch (a user is typing in an idle conversation; `engine/prefetch.py`, owned here) is the
lowest priority: its swap-ins go in the step's copies and its recomputes run as internal
turns that sample nothing. New ones start only when no turn waits for admission (and, with
no `prefetch_share`, no real turn runs); running ones get what real turns leave of the
budget (at most `prefetch_share` of it while real turns run, never more than
`prefetch_step_tokens`), are the first suspended, give their room up to a waiting turn that
cannot be admitted, and end when a real turn of their conversation comes (a running one is
taken over by it: `take_over`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Collection
from operator import attrgetter

from engine.cache.manager import KVCacheManager, NoRoom
from engine.plan import Fetch, Piece, StepPlan, history
from engine.prefetch import Prefetcher
from engine.request import PrefetchEnd, Request, Status
from engine.stream import StreamState
from engine.types import FinishReason

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        cache: KVCacheManager,
        max_batch_tokens: int,
        max_running: int,
        unified: bool = True,
        prefetch_share: float = 0.25,
        prefetch_step_tokens: int | None = None,
        now: Callable[[], float] = time.time,
        stop_token_ids: Collection[int] = (),
        max_context: int = 1 << 30,
    ) -> None:
        self.cache = cache
        self.stop_token_ids = stop_token_ids  # what a turn's token ends it at (`update`)
        self.max_context = max_context
        self.now = now  # the engine's clock: wall time, or a simulation's
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.unified = unified
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # real turns and admitted recompute prefetches
        self.prefetch = Prefetcher(
            cache, max_batch_tokens, prefetch_share, prefetch_step_tokens, now
        )

    def add(self, req: Request, prefetch: Request | None = None) -> None:
        """Queue a real turn. `prefetch`: the recompute prefetch of its conversation that
        its coming superseded (`Prefetcher.supersede`): a running one is taken over, a
        queued one hands its history read on."""
        if prefetch is not None and prefetch.status == Status.RUNNING:
            self.take_over(prefetch, req)
            return
        if prefetch is not None and prefetch.base == req.base:
            req.prefix, req.fetch = prefetch.prefix, prefetch.fetch
            req.loaded, req.read_for = prefetch.loaded, prefetch.read_for
        req.status = Status.WAITING
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        """Queue `req` after every waiting turn of an earlier or equal rank (most turns rank
        last: a scan from the end stops at once)."""
        i = len(self.waiting)
        while i > 0 and self.waiting[i - 1].rank > req.rank:
            i -= 1
        self.waiting.insert(i, req)

    def take_over(self, prefetch: Request, req: Request) -> None:
        """The real turn `req` goes on from where the running `prefetch` of its conversation
        is: in its place in the running batch, with the recompute left to do, then its own
        prompt."""
        self.prefetch.take_over(prefetch, req)
        req.admitted_once = True
        req.stats.admitted_s = self.now()
        self.running[self.running.index(prefetch)] = req
        self._run(req, list(prefetch.pending))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefetch.has_work())

    def turns(self) -> list[Request]:
        """The real turns and prefetches running, then the real turns waiting."""
        return [*self.running, *self.waiting]

    def queued(self) -> list[Request]:
        """What waits for admission, real turns and recompute prefetches: whose history
        reads the engine collects before each plan."""
        return [*self.waiting, *self.prefetch.queue]

    def counts(self) -> tuple[int, int]:
        """Turns running (prefetches too) and waiting."""
        return len(self.running), len(self.waiting)

    def running_turns(self) -> int:
        """Real turns running (no prefetch)."""
        return sum(1 for r in self.running if not r.prefetch)

    def hint(self, state: StreamState, seq: int, now: float) -> bool:
        """Its user is typing: a prefetch of the conversation (`Prefetcher.hint`)."""
        return self.prefetch.hint(state, seq, now)

    def supersede(self, conversation_id: str, keep: bool) -> Request | None:
        """A real turn of the conversation comes (or the conversation is forgotten): its
        prefetch ends, but a running recompute if `keep` (the context stays as it is), for
        the turn to take over (`add`). Returns the recompute that was in flight, if any."""
        req = self.prefetch.supersede(conversation_id)
        if req is not None and not (keep and req.status == Status.RUNNING):
            self._end_prefetch(req, PrefetchEnd.SUPERSEDED)
        return req

    # ---- planning a step ---------------------------------------------------------------------

    def schedule(self, swap_in_busy: bool = False) -> StepPlan:
        """Plan one step. `swap_in_busy`: an earlier swap-in is still being copied, so no
        ahead-of-time swap-out is started (swap-in has priority)."""
        self.cache.begin_step()
        for r in self.running:  # the last plan's loads from the disk tier are done
            r.loading = []
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
        if prefill_step and not self.waiting and self.prefetch.may_start(self._idle()):
            budget = self._admit(budget, plan, prefetch=True)
            plan.before.extend(self.prefetch.swap_in())
        plan.after.extend(self.cache.swap_out_ahead(busy=swap_in_busy))
        return plan

    def _continue(self, reqs: list[Request], budget: int, plan: StepPlan, prefill: bool) -> int:
        """Schedule running turns' pending tokens, the earliest-arrived first."""
        for req in sorted(reqs, key=attrgetter("seq")):
            if budget <= 0:
                break
            if req.status != Status.RUNNING:  # suspended earlier in this step
                continue
            if not self.unified and req.in_prefill != prefill:
                continue
            budget -= self._take(req, self._budget(req, budget), plan)
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

    def _budget(self, req: Request, budget: int) -> int:
        """What `req` may take of the step's `budget`: a prefetch only its share."""
        return self.prefetch.budget(budget, self._idle()) if req.prefetch else budget

    def _take(self, req: Request, budget: int, plan: StepPlan) -> int:
        """Schedule up to `budget` of a running turn's pending tokens; returns how many."""
        taken = 0
        while req.pending and taken < budget:
            start, end = req.pending[0]
            stop = min(end, start + budget - taken)
            if not self._room(req, start, stop, plan):
                break
            sample = stop == req.total and not req.prefetch
            plan.pieces.append(Piece(req, start, stop, sample=sample))
            taken += stop - start
            if stop < end:
                req.pending[0] = (stop, end)
                break
            req.pending.pop(0)
        return taken

    def _room(self, req: Request, start: int, upto: int, plan: StepPlan) -> bool:
        """Blocks for positions [start, upto), suspending the latest-arrived turns if needed."""
        table, kv_len = req.table, req.state.kv_len
        while self.cache.grow(table, kv_len, upto, plan.before, start) is None:
            alive = [r for r in self.running if r.status == Status.RUNNING]
            if alive == [req] and not req.prefetch:  # it alone fills the GPU tier: it
                # cannot grow any further (a prefetch never grows: it is suspended below)
                plan.full.append(req)
                return False
            victim = max(alive, key=lambda r: (r.prefetch, r.rank, r.seq))
            self._suspend(victim, plan)
            if victim is req:
                return False
        return True

    def _discard_partial_recompute(self, req: Request) -> None:
        """A recompute of dropped chunks that has not finished leaves invalid KV behind: the
        positions up to the end of the last unfinished one are dropped (with chunks loaded
        from disk between two recomputes: they are read again)."""
        kv = req.state.kv_len
        unfinished = [min(end, kv) for start, end in req.pending if start < kv]
        if unfinished:
            self.cache.drop_prefix(req.table, max(unfinished))
            req.pending = [(max(s, kv), e) for s, e in req.pending if e > kv]

    def _unload(self, req: Request, plan: StepPlan) -> None:
        """`req` leaves the batch in the step that admitted it: the chunks it was to load
        from disk hold nothing yet (the copies run after planning), so they and what is
        before them are dropped, not swapped out."""
        if not req.loading:
            return
        ids = {id(x) for x in req.loading}
        plan.before.load = [x for x in plan.before.load if id(x) not in ids]
        self.cache.drop_prefix(req.table, req.state.kv_len)
        req.loading = []

    def _suspend(self, req: Request, plan: StepPlan) -> None:
        self._unload(req, plan)
        # What it was to compute this step goes too: by rank, the victim may be a turn that
        # `_continue` (by arrival) planned before the one that needs its room. A real turn's
        # pending tokens are planned again from its KV when it is admitted again (`_start`).
        plan.pieces[:] = [p for p in plan.pieces if p.req is not req]
        if req.prefetch:  # a prefetch is not worth a swap-out: it just ends, all of it undone
            n = req.stats.recomputed_tokens
            req.pending = [(0, n)] if n else []
            self._end_prefetch(req, PrefetchEnd.SUSPENDED)
            return
        self._discard_partial_recompute(req)
        plan.before.extend(self.cache.suspend(req.table, req.state.kv_len))
        self.running.remove(req)
        req.status = Status.WAITING
        req.stats.suspensions += 1
        self._enqueue(req)  # by rank: behind a waiting step of a job begun before its own

    def _can_admit(self, req: Request) -> bool:
        if req.prefetch:
            return self.cache.can_prefetch(req.table, req.total)
        return self.cache.can_admit(req.table, req.total)

    def _admit(self, budget: int, plan: StepPlan, prefetch: bool = False) -> int:
        """Admit waiting turns in order while the cache has room for each one's context.
        `prefetch`: admit recompute prefetches instead, the same way (making room evicts
        idle chunks by value, as for a turn: the typing conversation is worth the most); one
        that waited too long is given up."""
        queue = self.prefetch.queue if prefetch else self.waiting
        skipped: list[Request] = []
        try:
            while queue and budget > 0 and len(self.running) < self.max_running:
                req = queue[0]
                status = history(req, self.cache, plan)
                if status == Fetch.PENDING:
                    skipped.append(queue.popleft())  # its history is still being read
                    continue
                if status == Fetch.FAILED:
                    if prefetch:  # the real turn will read (and report) it again
                        self._end_prefetch(req, PrefetchEnd.FAILED)
                    else:
                        plan.failed.append(queue.popleft())
                    continue
                if prefetch and self.prefetch.too_late(req):
                    self._end_prefetch(req, PrefetchEnd.EXPIRED)
                    continue
                if not self._can_admit(req):
                    if not prefetch and self._yield_prefetch(plan):
                        continue  # a running prefetch gave its room back: look again
                    break
                try:
                    self._start(req, plan)
                except NoRoom as e:  # it waits; what was evicted still moves
                    plan.before.extend(e.copies)
                    break
                queue.popleft()
                budget -= self._take(req, self._budget(req, budget), plan)
        finally:  # whatever happens, a turn whose history is being read stays queued
            queue.extendleft(reversed(skipped))
        return budget

    def _yield_prefetch(self, plan: StepPlan) -> bool:
        """End the latest running prefetch, if any, so that its context no longer holds the
        GPU tier's room that a waiting real turn needs."""
        prefetches = [r for r in self.running if r.prefetch and r.status == Status.RUNNING]
        if not prefetches:
            return False
        self._suspend(max(prefetches, key=lambda r: r.seq), plan)
        return True

    def _start(self, req: Request, plan: StepPlan) -> None:
        """Bring an admitted turn's context to the GPU tier and queue what it must compute:
        the dropped prefix, then its own tokens."""
        loaded, span = req.loaded, None
        if loaded is not None and self.cache.loadable(req.table) == loaded.dropped:
            span = (loaded.first, loaded.last)  # else more was dropped meanwhile: recompute
            windows = self.cache.windows
            if not windows.loads_hold_pages(req.table, span, req.state.kv_len, loaded.pages):
                span = None  # a file lacks pages a sliding layer reads: recompute
        adm = self.cache.admit(req.table, req.state.kv_len, req.total, req.prefetch, span)
        plan.before.extend(adm.copies)
        req.loading = [(loaded.parts[i], block) for i, block in adm.loads]  # type: ignore[union-attr]
        plan.before.load += req.loading
        req.loaded = None
        if not req.admitted_once:  # a resumed turn keeps the figures of its first admission
            req.admitted_once = True
            req.stats.admitted_s = self.now()
            req.stats.cached_tokens = adm.cached_tokens
            req.stats.swapped_in_tokens = adm.swapped_in_tokens
            req.stats.prefetched_tokens = adm.prefetched_tokens
            req.stats.disk_tokens = adm.disk_tokens
        start = req.state.kv_len if adm.recompute_from is None else adm.recompute_from
        req.stats.recomputed_tokens += adm.recompute_tokens + req.state.kv_len - start
        self.running.append(req)
        self._run(req, [(0, adm.recompute_tokens)] if adm.recompute_tokens else [], start)

    def _run(self, req: Request, pending: list[tuple[int, int]], start: int | None = None) -> None:
        """`req` is in the running batch: it computes `pending`, then its positions from
        `start` on (default: its tokens that have no KV yet)."""
        req.pending = pending
        start = req.state.kv_len if start is None else start
        if start < req.total:
            req.pending.append((start, req.total))
        req.status = Status.RUNNING

    # ---- after a step ----------------------------------------------------------------------

    def launched(self, plan: StepPlan) -> dict[Request, int]:
        """The plan's forward was launched: its pieces' positions count as computed (the
        device runs them in order); recompute prefetches with nothing left end. Returns each
        advanced turn's computed length before the step (`end` puts it back for a turn that
        ends before the step's tokens are read)."""
        before: dict[Request, int] = {}
        for p in plan.pieces:
            req, state = p.req, p.req.state
            if p.end > state.kv_len:
                before.setdefault(req, state.kv_len)
                state.kv_len = p.end
            if req.prefetch and req.status == Status.RUNNING and not req.pending:
                self._end_prefetch(req, PrefetchEnd.DONE)
        for req, length in before.items():  # this step may be taken back: up to its start
            self.cache.windows.slide(req.table, length)
        return before

    def update(
        self, rows: list[Request], tokens: list[int], rewind: dict[Request, int]
    ) -> list[Request]:
        """A step's tokens were read, one per row: each turn takes its own (one that ended
        meanwhile drops it); those a token ends leave (`end`, with `rewind`: the lagged step
        in flight) and are returned for the engine to close."""
        now = self.now()
        ended = []
        for req, token in zip(rows, tokens, strict=True):
            if req.status == Status.FINISHED:
                continue
            reason = req.accept(token, now, self.stop_token_ids, self.max_context)
            if reason is not None:
                self.end(req, reason, rewind)
                ended.append(req)
        return ended

    def end(self, req: Request, reason: FinishReason, rewind: dict[Request, int]) -> None:
        """End a real turn while a lagged step may hold its next token or positions: the
        token is dropped (`Request.take_back`), and a running turn's positions in that step
        (`rewind`: its length before it) do not count as computed (its stream's tail keeps
        them; its next turn computes them again), as if that step had not planned it."""
        unwind(req, rewind)
        self.finish(req, reason)

    def _end_prefetch(self, req: Request, why: PrefetchEnd) -> None:
        """End a recompute prefetch, running or queued: its pins go, its KV stays."""
        if req.status == Status.RUNNING:
            self._release(req)
        self.prefetch.end(req, why)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """End a real turn (running or waiting): release its pins, keep its KV."""
        req.finish_reason = reason
        if req.status == Status.RUNNING:
            self._release(req)
        elif req.status == Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
        req.status = Status.FINISHED

    def _release(self, req: Request) -> None:
        """A running request leaves the batch: its pins go, its KV stays (but for a
        recompute cut short)."""
        self._discard_partial_recompute(req)
        self.running.remove(req)
        self.cache.release(req.table, req.state.kv_len)

    def fail_all(self, error: BaseException) -> list[Request]:
        """End everything in flight (a step failed: the state may be broken): the real turns
        with ERROR (returned, `error` set, for the engine to close) and every prefetch.
        A request whose pins cannot be released still ends."""
        turns = [r for r in [*self.running, *self.waiting] if not r.prefetch]
        for req in [*self.running, *self.waiting, *self.prefetch.queue]:
            try:
                if req.prefetch:
                    self._end_prefetch(req, PrefetchEnd.FAILED)
                else:
                    req.error = error
                    self.finish(req, FinishReason.ERROR)
            except Exception:  # it is failed regardless
                log.exception("could not release %s", req.state.id)
                req.status = Status.FINISHED  # its reason is set already
        self.running.clear()
        self.waiting.clear()
        self.prefetch.clear()
        return turns


def unwind(req: Request, rewind: dict[Request, int]) -> None:
    """`req` ends while a lagged step may hold its next token (dropped) or, running, its
    positions (`rewind`: its length before that step, put back)."""
    req.take_back()
    if req.status == Status.RUNNING and req in rewind:
        req.state.kv_len = rewind[req]
