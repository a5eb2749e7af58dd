"""How likely an idle conversation is to send another turn, and how soon, learned from the
idle gaps the engine has seen: the weight of a chunk's recompute cost in the `returns`
eviction value (`Policy`).

The paper's value Cost(l) / T assumes a conversation idle for T comes back in about T. In
chat most idle conversations have ended, and one that has been idle longer than users
usually think is more likely ended than slow. So, as LHD ("least hit density", Beckmann et
al., NSDI '18) does for caches, the weight is the chance of a hit over the time a chunk
still has to be held for it:

    density(T) = q(T) / r(T)
    q(T) = p S(T) / (p S(T) + 1 - p)   the chance it comes back, having been idle for T
    r(T) = E[gap - T | gap > T]        how long it then takes, on average

where p is the share of turn ends followed by another turn and S the survival function
of the gaps seen between a turn's end and the next turn's arrival. Both are learned from
the recent turns (a window of them); the table over idle times is made non-increasing, so
a chunk only loses worth while it waits, and is zero past the longest gap seen (those
chunks then go first, by the paper's order: see `Policy.value`).
"""

from __future__ import annotations

import bisect
from collections import deque

# Idle times the table is kept at: 1/4 s to 2 days, 8 per doubling
EDGES = [0.25 * 2 ** (k / 8) for k in range(8 * 20)]


class Returns:
    def __init__(self, window: int = 2048, min_seen: int = 64) -> None:
        self.min_seen = min_seen
        self.gaps: deque[float] = deque(maxlen=window)
        # Counts of turn ends and of returns, decayed by turn end (about the last `window`)
        self._decay = 1.0 - 1.0 / window
        self.ends = 0.0
        self.back = 0.0
        self._table: list[float] | None = None

    def ended(self) -> None:
        """A turn ended: its conversation may come back, or not."""
        self.ends = self.ends * self._decay + 1.0
        self.back *= self._decay

    def retract(self) -> None:
        """The last turn end counted was an agent's tool call: its gap is a tool's, learned
        apart (`toolwait`), so it is not counted among the ends a return may follow."""
        self.ends = max(0.0, self.ends - 1.0)

    def returned(self, gap_s: float) -> None:
        """A turn arrived `gap_s` after the conversation's previous turn ended."""
        self.gaps.append(max(0.0, gap_s))
        self.back += 1.0
        self._table = None

    @property
    def ready(self) -> bool:
        """Enough gaps seen to trust the table (before that, the paper's value)."""
        return len(self.gaps) >= self.min_seen and self.ends > 0

    @property
    def p(self) -> float:
        """The share of turn ends followed by another turn."""
        return min(0.99, max(0.01, self.back / self.ends)) if self.ends else 0.5

    def density(self, idle_s: float) -> float:
        """Chance of a return per second still to hold, after `idle_s` idle (see above)."""
        table = self._table if self._table is not None else self._build()
        k = max(0, bisect.bisect_right(EDGES, idle_s) - 1)
        return table[k]

    def _build(self) -> list[float]:
        gaps = sorted(self.gaps)
        n, p = len(gaps), self.p
        suffix = [0.0] * (n + 1)  # sums of the largest gaps
        for i in range(n - 1, -1, -1):
            suffix[i] = suffix[i + 1] + gaps[i]
        table, low = [], float("inf")
        for t in EDGES:
            i = bisect.bisect_right(gaps, t)  # gaps[i:] are those longer than t
            m = n - i
            if m == 0:
                d = 0.0
            else:
                s = m / n
                q = p * s / (p * s + 1.0 - p)
                r = max(suffix[i] / m - t, 1e-3)
                d = q / r
            low = min(low, d)
            table.append(low)
        self._table = table
        return table
