"""Unified scheduling: no prefill or decode phases, only tokens still to compute.

Each step takes the running turns' tokens first-come first-served up to the token budget
(a decode is one token, a long prompt may be split over steps), then admits waiting turns
while the cache keeps room for decoding. When decoding runs out of GPU blocks, the
latest-arrived running turns are suspended: their KV leaves the GPU and they wait again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.cache import KVCacheManager
from engine.request import FINISHED, RUNNING, WAITING, Request


@dataclass
class Piece:
    """One sub-request of a step: positions [start, end) of a turn's conversation."""

    req: Request
    start: int
    end: int
    sample: bool  # its last position is the last known token: sample the next one


class Scheduler:
    def __init__(
        self,
        cache: KVCacheManager,
        max_batch_tokens: int,
        max_running: int,
        unified: bool = True,
        fetch: Callable[[Request, int], bool] | None = None,
    ) -> None:
        self.cache = cache
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.unified = unified
        # fetch(req, n): True once req.prefix holds history [0, n); else starts reading it.
        self.fetch = fetch or (lambda req, n: req.prefix is not None and len(req.prefix) >= n)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        req.status = WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning a step ---------------------------------------------------------------------

    def schedule(self) -> list[Piece]:
        budget = self.max_batch_tokens
        pieces: list[Piece] = []
        prefill_step = self.unified or self._wants_prefill()
        for req in sorted(self.running, key=lambda r: r.seq):
            if budget <= 0:
                break
            if req.status != RUNNING:  # suspended earlier in this loop
                continue
            if not self.unified and req.in_prefill != prefill_step:
                continue
            budget -= self._take(req, budget, pieces)
        if prefill_step:
            budget = self._admit(budget, pieces)
        return pieces

    def _wants_prefill(self) -> bool:
        if any(r.in_prefill for r in self.running):
            return True
        return (
            bool(self.waiting)
            and len(self.running) < self.max_running
            and self._can_admit(self.waiting[0])
        )

    def _take(self, req: Request, budget: int, pieces: list[Piece]) -> int:
        """Schedule up to `budget` of a running turn's pending tokens; returns how many."""
        taken = 0
        while req.pending and taken < budget:
            start, end = req.pending[0]
            stop = min(end, start + budget - taken)
            if not self._room(req, stop):
                break
            pieces.append(Piece(req, start, stop, sample=stop == req.total))
            taken += stop - start
            if stop < end:
                req.pending[0] = (stop, end)
                break
            req.pending.pop(0)
        return taken

    def _room(self, req: Request, upto: int) -> bool:
        """Blocks for positions up to `upto`, suspending the latest-arrived turns if needed."""
        while not self.cache.grow(req.conv, upto):
            victim = max((r for r in self.running if r.status == RUNNING), key=lambda r: r.seq)
            self.suspend(victim)
            if victim is req:
                return False
        return True

    def suspend(self, req: Request) -> None:
        self.cache.suspend(req.conv)
        self.running.remove(req)
        req.status = WAITING
        req.stats.suspensions += 1
        self.waiting.appendleft(req)

    def _dropped_tokens(self, req: Request) -> int:
        conv = req.conv
        return min(conv.n_dropped * self.cache.chunk_size, conv.kv_len)

    def _can_admit(self, req: Request) -> bool:
        return self.cache.can_admit(req.conv, req.total)

    def _admit(self, budget: int, pieces: list[Piece]) -> int:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[0]
            if not self.fetch(req, req.prefix_needed(self._dropped_tokens(req))):
                skipped.append(self.waiting.popleft())  # its history is still being read
                continue
            if not self._can_admit(req):
                break
            self.waiting.popleft()
            adm = self.cache.admit(req.conv, req.total)
            if not req.admitted_once:
                req.admitted_once = True
                req.stats.cached_tokens = adm.cached_tokens
                req.stats.swapped_in_tokens = adm.swapped_in_tokens
            req.stats.recomputed_tokens += adm.recompute_tokens
            req.pending = [(0, adm.recompute_tokens)] if adm.recompute_tokens else []
            if req.conv.kv_len < req.total:
                req.pending.append((req.conv.kv_len, req.total))
            req.status = RUNNING
            self.running.append(req)
            budget -= self._take(req, budget, pieces)
        self.waiting.extendleft(reversed(skipped))
        return budget

    # ---- after a step ----------------------------------------------------------------------

    def finish(self, req: Request, reason: str) -> None:
        """End a turn (running or waiting): release its pins, keep its KV."""
        if req.status == RUNNING:
            self.running.remove(req)
            self.cache.release(req.conv)
        elif req.status == WAITING and req in self.waiting:
            self.waiting.remove(req)
        req.status = FINISHED
        req.finish_reason = reason
        conv = req.conv
        conv.length = req.total
        conv.tail = req.tokens[conv.kv_len - req.base :]
        conv.busy = False
