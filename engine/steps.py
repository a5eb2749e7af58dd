"""The step loop: plan, launch, update, close. In order, a step's tokens are read before it
returns; a step ahead (`async_steps`), step N is launched before N-1's tokens are read, and
the next plan counts on placeholders for them (docs/internals.md, "The host a step ahead")."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.backends import Backend
from engine.cache.manager import KVCacheManager
from engine.conversations import Conversations
from engine.disk.tier import DiskTier
from engine.kv_pool import KVPool
from engine.plan import StepPlan
from engine.reads import Reads
from engine.request import Request, Status
from engine.runner import Runner
from engine.sampler import Sampled
from engine.scheduler import Scheduler, unwind
from engine.snapshot import EngineCounters
from engine.types import FinishReason

log = logging.getLogger(__name__)


@dataclass
class Flight:
    """A launched step whose tokens the host has not read: the lagged path reads them during
    the next step's forward."""

    rows: list[Request]  # the turn of each sampled token, in order
    before: dict[Request, int]  # each turn's kv_len before the step's pieces moved it
    sampled: Sampled | list[int] | None  # the tokens: on their way (lagged), or read already

    def on_device(self) -> torch.Tensor | None:
        """The tokens on the device: what the next step's placeholders are filled from."""
        return self.sampled.tokens if isinstance(self.sampled, Sampled) else None

    def tokens(self) -> list[int]:
        s = self.sampled
        if s is None:
            return []
        return s if isinstance(s, list) else s.tolist()


@dataclass
class Steps:
    """Runs the scheduler's plans on the backend's pool and runner, and closes the turns
    they end. The engine holds its lock around every call."""

    backend: Backend
    scheduler: Scheduler
    cache: KVCacheManager
    conversations: Conversations
    pool: KVPool
    runner: Runner
    reads: Reads
    disk: DiskTier | None
    counters: EngineCounters
    now: Callable[[], float]
    ahead: bool  # launch step N before reading N-1's tokens
    flight: Flight | None = field(default=None)  # the lagged step launched and not read yet

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.flight is not None

    def step(self) -> list[Request]:
        """One batch: schedule -> launch -> update -> close. Returns the turns that ended
        (lagged: those the previous step's tokens ended, or cancelled, failed, out of room
        in this call)."""
        ended = self._drop_cancelled()
        self.reads.collect(self.scheduler.queued())
        plan = self.scheduler.schedule(swap_in_busy=self.pool.swap_in_busy())
        self.reads.start(plan.reads)
        if self.disk is not None:
            self.disk.spill(self.conversations.streams)
        for req in plan.failed:  # its history could not be read: that turn alone fails
            log.error("history read for %s failed: %s", req.state.id, req.error)
            ended.append(self._end(req, FinishReason.ERROR))
        if self.ahead:
            flight = self._launch(plan)
            previous, self.flight = self.flight, flight
            ended += self._update(previous)
            ended += self._end_full(plan)  # after the token in flight: it counts
            if flight is not None:
                self._run_ahead(flight)
        else:
            ended += self._end_full(plan)
            ended += self._update(self._launch(plan))
        self._publish(ended)  # after the step's copies: publishing may free blocks
        self.counters.steps += 1
        return ended

    def flush(self) -> list[Request]:
        """Read the tokens of the lagged step in flight, if any, launching none; returns the
        turns they ended."""
        flight, self.flight = self.flight, None
        ended = self._update(flight)
        self._publish(ended)
        return ended

    def fail_all(self, error: BaseException) -> list[Request]:
        """End every turn in flight with `error` (a step failed: the state may be broken)."""
        rewind = self._rewind()
        for req in self.scheduler.turns():
            try:
                unwind(req, rewind)
            except Exception:  # the turn fails regardless
                log.exception("could not unwind %s", req.state.id)
        self.flight = None  # its tokens are not read: the state may be broken
        failed = self.scheduler.fail_all(error)
        now = self.now()
        for req in failed:
            try:
                self.conversations.close(req, now)
            except Exception:  # the turn is failed regardless
                log.exception("could not close %s", req.state.id)
                self.conversations.claims.release(req.state.id)
        return failed

    def _launch(self, plan: StepPlan) -> Flight | None:
        """Start the plan's copies and forward (sampling on the device). Lagged, the tokens
        are not waited for; else they are read before this returns."""
        if not plan.pieces:
            self.pool.begin_step(plan.before)
            self.pool.swap_in_now()  # no forward to pipeline it with
            self.scheduler.launched(plan)
            self.pool.end_step(plan.after)
            return None
        sampled: Sampled | list[int] | None
        if self.ahead:
            on_device = None if self.flight is None else self.flight.on_device()
            sampled = self.runner.launch(plan.pieces, plan.before, on_device)
        else:
            sampled = self.runner.step(plan.pieces, plan.before)
        before = self.scheduler.launched(plan)
        self.pool.end_step(plan.after)
        return Flight([p.req for p in plan.pieces if p.sample], before, sampled)

    def _update(self, flight: Flight | None) -> list[Request]:
        """Hand a launched step's tokens to the scheduler (the host waits for them here) and
        close the turns they ended."""
        if flight is None or not flight.rows:
            return []
        tokens = flight.tokens()
        self.counters.generated_tokens += sum(r.status != Status.FINISHED for r in flight.rows)
        ended = self.scheduler.update(flight.rows, tokens, self._rewind())
        now = self.now()
        for req in ended:
            self.conversations.close(req, now)
        return ended

    def _end(self, req: Request, reason: FinishReason) -> Request:
        self.scheduler.end(req, reason, self._rewind())
        self.conversations.close(req, self.now())
        return req

    def _rewind(self) -> dict[Request, int]:
        """What a turn ending now takes back: its positions in the lagged step in flight."""
        return {} if self.flight is None else self.flight.before

    def _end_full(self, plan: StepPlan) -> list[Request]:
        """Turns with no room to generate more end as if by max_tokens."""
        return [self._end(r, FinishReason.LENGTH) for r in plan.full if r.status == Status.RUNNING]

    def _drop_cancelled(self) -> list[Request]:
        return [
            self._end(r, FinishReason.CANCELLED)
            for r in self.scheduler.turns()
            if r.cancelled and r.status != Status.FINISHED
        ]

    def _run_ahead(self, flight: Flight) -> None:
        """Plan the next step before this one's tokens are known: each turn sampling in it
        whose token is not known to be its last gets a placeholder for it. Turns whose next
        step needs a mask from the host (a grammar, min_tokens not reached) go step by step:
        the mask needs the token."""
        limit = self.scheduler.max_context
        for row, req in enumerate(flight.rows):
            sp = req.turn.sampling
            n = len(req.output) + 1  # with the token in flight
            if (
                req.status == Status.RUNNING
                and req.guide is None
                and sp.min_tokens <= n < sp.max_tokens
                and req.total + 1 < limit
            ):
                req.run_ahead(row)

    def _publish(self, ended: list[Request]) -> None:
        """First turns that ended share their prompt's full chunks with later conversations."""
        for req in ended:
            if req.chain and req.finish_reason is not FinishReason.ERROR:
                n = req.state.kv_len // self.cache.chunk_size
                self.cache.publish(req.table, req.chain[:n])
