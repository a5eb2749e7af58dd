"""Eviction order: the retention value V = Cost(l) / T of Pensieve, Cost(l) weighted by
the learned chance of a return (`returns`), or plain LRU; kept longer while a conversation
waits for a tool (`toolwait`), scaled by a client's priority and held by its pin (`pins`)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine.cache.chunks import ChunkTable
from engine.cache.pins import Pins
from engine.cache.returns import Returns
from engine.cache.toolwait import ToolWaits
from engine.types import Eviction


@dataclass
class CostModel:
    """Seconds to recompute one chunk whose context is `l` tokens long: attention measured at
    powers of two (linearly interpolated) plus a constant for the rest of the layers."""

    contexts: list[int]  # increasing
    attention_s: list[float]
    other_s: float

    def __call__(self, context: int) -> float:
        xs, ys = self.contexts, self.attention_s
        if context <= xs[0]:
            return ys[0] + self.other_s
        if context >= xs[-1]:  # extrapolate the last segment: attention is linear in l
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
            return ys[-1] + slope * (context - xs[-1]) + self.other_s
        i = bisect.bisect_right(xs, context)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (context - x0) / (x1 - x0) + self.other_s

    def to_dict(self) -> dict:
        return {"contexts": self.contexts, "attention_s": self.attention_s, "other_s": self.other_s}

    @staticmethod
    def from_dict(d: dict) -> CostModel:
        return CostModel(list(d["contexts"]), list(d["attention_s"]), float(d["other_s"]))

    @staticmethod
    def linear(chunk_size: int = 32, max_context: int = 1 << 16) -> CostModel:
        """A shape-only model (attention grows linearly), for tests and before profiling."""
        xs = [chunk_size << i for i in range(max(1, (max_context // chunk_size).bit_length()))]
        return CostModel(xs, [x * 1e-6 for x in xs], chunk_size * 1e-5)


MIN_IDLE_S = 1e-3
# `returns`: past the longest gap seen a chunk's density is 0; this keeps the paper's order
# among those (far below any density: a return in a window of gaps is at least 1e-6 per s)
TIE = 1e-9


Key = tuple[bool, bool, float, int]  # (pinned, expected, value, chunk index)


class Policy:
    """Sort key of a chunk: lower goes first. `now` is fixed per eviction round.

    The key is (pinned, expected, value, chunk): chunks of pinned conversations come after
    every other chunk (and the evictor never drops them), then those of conversations
    whose user is typing, each group in value order."""

    def __init__(
        self,
        kind: Eviction | str,
        cost: CostModel,
        chunk_size: int,
        clock,
        tool_value: bool = True,
        tool_holds: bool = False,
    ) -> None:
        self.kind = Eviction(kind)
        self.cost = cost
        self.chunk_size = chunk_size
        self.clock = clock
        # Conversations whose user is typing, until when: their next turn is expected, so
        # their chunks are valued as if active now (kept over any other idle chunk, while
        # running turns, whose chunks are pinned, can still take them when nothing else is left).
        self.expected: dict[str, float] = {}
        # Conversations whose expectation changed since the eviction order last took them:
        # only their keys moved, so the order re-keys them alone (`touched`).
        self._touched: list[str] = []
        # With a disk tier a dropped chunk comes back for at most the time to read it: the
        # seconds that caps a chunk's cost (None: no disk tier, or it does not write)
        self.restore_s: Callable[[], float | None] | None = None
        self.returns = Returns()  # fed by the engine at each turn's end and arrival
        self.pins = Pins()  # clients' retention: pins and priorities
        self.tools = ToolWaits()  # conversations waiting for a tool's result
        self.tool_value = tool_value  # a waiting conversation is valued by its tool's wait
        self.tool_holds = tool_holds  # ... and held in memory for most tools' wait

    # ---- what happened: the engine tells, the policy updates what it holds --------------------

    def arrived(self, conversation_id: str, now: float, idle_since: float | None) -> bool:
        """A turn of the conversation was queued (idle since `idle_since`, None: never ended
        one): `returns` learns the gap, a tool's result its tool's time; it is about to run,
        so its chunks are the last idle ones to go. True: it begins a new job (it carries
        no tool's result)."""
        waiting = self.tools.is_waiting(conversation_id)
        if idle_since is not None and not waiting:  # a tool's result is learned apart
            self.returns.returned(now - idle_since)
        self.tools.arrived(conversation_id, now)
        self.expect(conversation_id, math.inf)
        hold = self.tools.hold_s() if self.tool_holds else None
        if hold is not None:  # a tool wait's hold: renewed while the turn waits to run
            self.pins.hold_queued(conversation_id, now, hold)
        return not waiting

    def withdrawn(self, conversation_id: str) -> None:
        """A turn accepted for the conversation did not run (refused, or it failed to
        queue): nothing of it is expected or held any more."""
        self.unexpect(conversation_id)
        self.pins.unhold(conversation_id)

    def ended(self, conversation_id: str) -> None:
        """The conversation's turn ended (`returns` learns from it)."""
        self.withdrawn(conversation_id)
        self.returns.ended()

    def called_tools(self, conversation_id: str, tools: list[str], since: float) -> None:
        """Its last turn (ended at `since`) called `tools`: it waits for their results,
        expected back in the time those tools took before, its KV held in memory meanwhile."""
        if not self.tools.is_waiting(conversation_id):  # its end was a tool call's
            self.returns.retract()
        self.tools.wait(conversation_id, tools, since)
        hold = self.tools.hold_s() if self.tool_holds else None
        if hold is not None:  # most results come back within it: keep its KV till then
            self.pins.hold(conversation_id, since + hold)
        elif self.tool_value:  # most come back within it: kept over idle chats
            self.expect(conversation_id, since + self.tools.expect_s())

    def forgotten(self, conversation_id: str, erased: bool) -> None:
        """The conversation's cache was forgotten; `erased`: it was deleted, its pin goes too
        (a cache reset keeps it for the next turn)."""
        self.tools.forget(conversation_id)
        self.pins.unhold(conversation_id)
        if erased:
            self.pins.release(conversation_id)

    def learned(self) -> tuple[float, float]:
        """What the turns served taught `returns` so far: for a caller that must leave no
        trace (a warm-up) to put back with `unlearn`."""
        return self.returns.ends, self.returns.back

    def unlearn(self, learned: tuple[float, float]) -> None:
        self.returns.ends, self.returns.back = learned

    @property
    def expectations(self) -> int:
        """Changes of what every key may depend on besides time (pins, tools' waits): the
        cache's eviction order is stale. One conversation's expectation is `touched`."""
        return self.pins.changes + self.tools.changes

    def touched(self) -> list[str]:
        """The conversations whose expectation changed since the last call."""
        out, self._touched = self._touched, []
        return out

    def expect(self, conversation_id: str, until: float) -> None:
        self.expected[conversation_id] = until
        self._touched.append(conversation_id)

    def unexpect(self, conversation_id: str) -> None:
        if self.expected.pop(conversation_id, None) is not None:
            self._touched.append(conversation_id)

    def is_expected(self, conversation_id: str, now: float) -> bool:
        return self.expected.get(conversation_id, 0.0) > now

    def last_active(self, conv: ChunkTable, now: float | None = None) -> float:
        if now is not None and self.is_expected(conv.id, now):
            return now
        t = self.clock.last_active(conv.id)
        return 0.0 if t is None else t  # never seen active: as idle as can be

    def value(self, conv: ChunkTable, chunk: int, now: float) -> float:
        """Retention value of a chunk: recompute cost over idle time, or (`returns`, once it
        has seen enough turns) times the chance of a return per second still to hold. A
        conversation waiting for a tool is worth at least Cost over the tool's expected time
        still to come; the client's priority scales the whole (0: a finished session).
        Per page it holds: a chunk inside a sliding window holds every group's pages
        (engine/kv_layout.py), one outside it only its full layers'. Where every layer
        slides, losing the first chunk after those `gone` recomputes them all from position
        0: it costs the chunks [0, chunk] (their mean, attention being linear in l)."""
        idle = max(now - self.last_active(conv, now), MIN_IDLE_S)
        cost = self.cost(chunk * self.chunk_size)
        if chunk and chunk == conv.gone == conv.n_dropped:
            cost = (chunk + 1) * self.cost(chunk * self.chunk_size // 2)
        cap = self.restore_s() if self.restore_s is not None else None
        if cap is not None:
            cost = min(cost, cap)
        if self.kind == Eviction.RETURNS and self.returns.ready:
            value = cost * (self.returns.density(idle) + TIE / idle)
        else:
            value = cost / idle
        wait = self.tools.remaining(conv.id, idle) if self.tool_value else None
        if wait is not None:  # it comes back when its tool does: about `wait` from now
            value = max(value, cost / max(wait, MIN_IDLE_S))
        if chunk < len(conv.chunks):  # a chunk's sliding pages are as many on either tier
            c = conv.chunks[chunk]
            value /= 1 + len(c.gpu_win or c.cpu_win or ())
        return value * self.pins.factor(conv.id)

    def key(self, conv: ChunkTable, chunk: int, now: float) -> Key:
        """Chunks of pinned, then of expected, conversations come after every other idle
        chunk."""
        pinned = self.pins.held(conv.id, now)
        expected = self.is_expected(conv.id, now)
        if self.kind == Eviction.LRU:
            return (pinned, expected, self.last_active(conv, now), chunk)
        return (pinned, expected, self.value(conv, chunk, now), chunk)

    def shared_key(self, holders: Iterable[ChunkTable], chunk: int, now: float) -> Key:
        """A chunk several conversations hold is worth the sum of what it is worth to each
        (LRU: it is as recent as its most recent holder); pinned if one holder is."""
        holders = list(holders)
        pinned = any(self.pins.held(c.id, now) for c in holders)
        expected = any(self.is_expected(c.id, now) for c in holders)
        if self.kind == Eviction.LRU:
            recent = max((self.last_active(c, now) for c in holders), default=0.0)
            return (pinned, expected, recent, chunk)
        return (pinned, expected, sum(self.value(c, chunk, now) for c in holders), chunk)

    def pinned(self, key: Key) -> bool:
        """The key is a pinned conversation's chunk's: never to be dropped."""
        return key[0]
