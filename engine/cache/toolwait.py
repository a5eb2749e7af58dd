"""Conversations waiting for a tool: a turn that ended in tool calls comes back when the
calls' results do. How long that takes is learned per tool name from the gaps seen between
such a turn's end and the next turn's arrival, as the `returns` value learns idle gaps
(engine/cache/returns.py); no hint from the client is needed.

While a conversation waits it is expected back (`Policy.expect`: kept over every idle
chunk, as a typing user's conversation is) for `expect_s`: the 90th percentile of every
tool's gaps seen, or PRIOR_S before enough are (an agent's first steps under pressure must
not lose their KV to chats that just ended). With `tool_holds` the server holds it instead
(`Pins.hold`: kept as a client's pin would keep it) for that percentile, so that most
results come back to their KV. One time for every tool, not each tool's own: the
holds of slow tools would then outlast those of fast ones, whose agents come back sooner
and lose their KV to them (in the agent benchmark that held more and recomputed more).

`remaining` is the expected wait still to come, E[gap - T | gap > T] over the tool's recent
gaps, having waited T already: `Policy.value` holds a waiting conversation's chunks as
worth Cost / min(T, remaining), never less than an idle chat's Cost / T. Once the wait has
outlasted every gap seen for a tool (it hangs, or a person answers it) it is an idle chat
again, so a tool that runs long does not hold memory forever.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from collections.abc import Sequence

ANY = ""  # the gaps of every tool: used for a tool seen too rarely on its own
HOLD_Q = 0.9  # a waiting conversation is held for this quantile of the tool gaps seen
PRIOR_S = 10.0  # expected back within this, before any gaps are learned: most tools are quick


class ToolWaits:
    def __init__(self, window: int = 256, min_seen: int = 4) -> None:
        self.window, self.min_seen = window, min_seen
        self.gaps: dict[str, deque[float]] = {}
        self.waiting: dict[str, tuple[tuple[str, ...], float]] = {}  # id -> (tools, since)
        self.changes = 0  # the eviction order is stale when this moves
        self._sorted: dict[str, tuple[list[float], list[float]]] = {}  # gaps, suffix sums
        self._lock = threading.Lock()

    def wait(self, conversation_id: str, tools: Sequence[str], since: float) -> None:
        """Its turn ended at `since` calling `tools`: it waits for their results."""
        with self._lock:
            self.waiting[conversation_id] = (tuple(sorted(set(tools))), since)
            self.changes += 1

    def arrived(self, conversation_id: str, now: float) -> None:
        """Its next turn came: learn how long its tools took, and it waits no more."""
        with self._lock:
            entry = self.waiting.pop(conversation_id, None)
            if entry is None:
                return
            tools, since = entry
            gap = max(0.0, now - since)
            for name in (*tools, ANY):
                self.gaps.setdefault(name, deque(maxlen=self.window)).append(gap)
                self._sorted.pop(name, None)
            self.changes += 1

    def forget(self, conversation_id: str) -> None:
        with self._lock:
            if self.waiting.pop(conversation_id, None) is not None:
                self.changes += 1

    def is_waiting(self, conversation_id: str) -> bool:
        return conversation_id in self.waiting

    def remaining(self, conversation_id: str, waited_s: float) -> float | None:
        """Seconds its tools are still expected to take, having taken `waited_s`; None when
        it waits for no tool, nothing is learned for them yet, or it outlasted every gap
        seen for one of them (then it is valued as an idle chat)."""
        entry = self.waiting.get(conversation_id)
        if entry is None:
            return None
        longest = 0.0
        for name in entry[0] or (ANY,):  # results come back when the slowest is done
            r = self._residual(name, waited_s)
            if r is None:
                return None
            longest = max(longest, r)
        return longest

    def hold_s(self) -> float | None:
        """How long to hold a conversation that starts waiting for a tool (None: too few
        gaps seen yet)."""
        table = self._table(ANY)
        if table is None:
            return None
        gaps = table[0]
        return gaps[min(len(gaps) - 1, int(HOLD_Q * len(gaps)))]

    def expect_s(self) -> float:
        """How long a conversation that starts waiting for a tool is expected back: the
        90th percentile of the gaps seen, or PRIOR_S before enough are."""
        hold = self.hold_s()
        return PRIOR_S if hold is None else hold

    def _residual(self, name: str, t: float) -> float | None:
        """E[gap - t | gap > t] over the tool's gaps (every tool's, if it was seen rarely)."""
        table = self._table(name) or self._table(ANY)
        if table is None:
            return None
        gaps, suffix = table
        i = bisect.bisect_right(gaps, t)
        m = len(gaps) - i
        return suffix[i] / m - t if m else None

    def _table(self, name: str) -> tuple[list[float], list[float]] | None:
        got = self._sorted.get(name)
        if got is not None:
            return got
        seen = self.gaps.get(name)
        if seen is None or len(seen) < self.min_seen:
            return None
        gaps = sorted(seen)
        suffix = [0.0] * (len(gaps) + 1)
        for i in range(len(gaps) - 1, -1, -1):
            suffix[i] = suffix[i + 1] + gaps[i]
        self._sorted[name] = (gaps, suffix)
        return gaps, suffix
