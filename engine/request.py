"""A turn in flight: the tokens it knows, the positions it still has to compute.

On the lagged path (`EngineConfig.async_steps`) a turn's next position is planned before its
last sampled token reaches the host: `run_ahead` appends a placeholder, -1 - r for row r of the
step that samples it, which the runner fills on the device from that step's tokens, and
`accept` later writes the token over it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from engine.cache.chunks import ChunkTable
from engine.disk.index import Loaded
from engine.guide import Matcher
from engine.stream import StreamState
from engine.types import FinishReason, Turn, TurnResult, TurnStats

log = logging.getLogger(__name__)


class Status(StrEnum):
    WAITING = "waiting"  # queued for admission (or suspended)
    RUNNING = "running"  # in the running batch
    FINISHED = "finished"


class PrefetchEnd(StrEnum):
    """Why a prefetch ended. Internal: a prefetch is no turn and has no result, so this is
    kept apart from the public `FinishReason`."""

    DONE = "done"  # its recompute is done: the context is on the GPU tier
    SUPERSEDED = "superseded"  # its conversation's real turn came (or it was forgotten)
    SUSPENDED = "suspended"  # gave its room up to real turns
    EXPIRED = "expired"  # found no room in time
    FAILED = "failed"  # its history read, or a step, failed


@dataclass(eq=False)
class Request:
    turn: Turn
    state: StreamState  # the conversation's stream (the engine writes it)
    table: ChunkTable  # where its KV lives (the cache writes it)
    seq: int  # arrival order
    base: int  # position of tokens[0] in the conversation
    tokens: list[int]  # positions [base, ...): uncomputed tail, prompt, then the outputs
    stats: TurnStats
    generator: torch.Generator | None = None
    on_token: Callable[[int], None] | None = None
    prefix: list[int] | None = None  # raw history, positions [0, len(prefix))
    fetch: Future | None = None
    pending: list[tuple[int, int]] = field(default_factory=list)  # position ranges to compute
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None  # a real turn's, once it ended
    prefetch_end: PrefetchEnd | None = None  # a prefetch's, once it ended
    cancelled: bool = False
    admitted_once: bool = False
    error: BaseException | None = None  # why it ended with FinishReason.ERROR
    prefetch: bool = False  # an internal turn that only recomputes the context (typing)
    handle: Any = None  # the front end's object for this turn (AsyncEngine: its TurnStream)
    guide: Matcher | None = None  # its grammar's matcher (engine/guide.py), until it ends
    # A conversation's first turn: hash chain of its prompt's full chunks, published when
    # it ends so that later conversations starting the same way can link them.
    chain: list[bytes] = field(default_factory=list)
    loaded: Loaded | None = None  # dropped chunks read back from the disk tier for it
    read_for: int = -1  # the dropped run (in chunks) its last disk tier read was for
    loading: list = field(default_factory=list)  # this step's loads (chunk tensors, GPU block)
    ahead: bool = False  # its last token is a placeholder for a token still on the device
    # Admission order: when its job began (`StreamState.job_since`): a turn that carries a
    # tool's result queues as early as the turn that started its agent loop
    rank: float = 0.0

    @property
    def generated(self) -> int:
        """Tokens sampled for it so far, the one still on the device included."""
        return len(self.output) + self.ahead

    @property
    def total(self) -> int:
        """Positions known so far: [0, total)."""
        return self.base + len(self.tokens)

    @property
    def in_prefill(self) -> bool:
        return (
            not self.pending or self.pending[0][1] - self.pending[0][0] > 1 or len(self.pending) > 1
        )

    def prefix_needed(self, dropped_tokens: int) -> int:
        """History tokens needed to recompute the dropped positions [0, dropped_tokens)."""
        return min(dropped_tokens, self.base)

    def accept(
        self, token: int, now: float, stop_token_ids, max_context: int
    ) -> FinishReason | None:
        """Its sampled token: kept, streamed, and checked against the stop tokens, the
        limits and its grammar. Returns why the turn ends with it (None: it goes on)."""
        if not self.output:
            self.stats.first_token_s = now
        ahead, self.ahead = self.ahead, False
        if ahead:  # its placeholder: the position after it is planned already
            self.tokens[-1] = token
        else:
            self.tokens.append(token)
        self.output.append(token)
        self.stats.completion_tokens += 1
        if self.on_token is not None:
            self.on_token(token)
        sp = self.turn.sampling
        if self.guide is not None and not self._guided(token):
            return FinishReason.ERROR
        if not sp.ignore_eos and (token in stop_token_ids or token in sp.stop_token_ids):
            return FinishReason.STOP
        if len(self.output) >= sp.max_tokens or self.total >= max_context:
            return FinishReason.LENGTH
        if not ahead:
            self.pending.append((self.total - 1, self.total))
        return None

    def run_ahead(self, row: int) -> None:
        """Its token is row `row` of the step just launched: stand a placeholder in for it, so
        that the next step computes its position before the host knows it."""
        self.tokens.append(-1 - row)
        self.ahead = True
        self.pending.append((self.total - 1, self.total))

    def take_back(self) -> None:
        """It ends before its token in flight is known: the placeholder goes (the token is
        dropped), and so does the position planned for it."""
        if self.ahead:
            self.tokens.pop()
            self.ahead = False
            self.pending = [(s, min(e, self.total)) for s, e in self.pending if s < self.total]

    def _guided(self, token: int) -> bool:
        """Its matcher takes the token; False (the turn fails) if the grammar refuses it,
        which its mask should have made impossible."""
        try:
            self.guide.consume(token)
        except ValueError as e:
            log.error("turn of %s: %s", self.state.id, e)
            self.error = e
            return False
        return True

    def token_range(self, start: int, end: int) -> list[int]:
        out: list[int] = []
        if start < self.base:
            assert self.prefix is not None and len(self.prefix) >= min(end, self.base)
            out.extend(self.prefix[start : min(end, self.base)])
        if end > self.base:
            out.extend(self.tokens[max(start, self.base) - self.base : end - self.base])
        return out

    def result(self) -> TurnResult:
        reason = self.finish_reason or FinishReason.CANCELLED
        return TurnResult(self.state.id, list(self.output), reason.value, self.stats)
