"""The learned chance of a return (`Returns`) and the `returns` eviction value built on it."""

from __future__ import annotations

import random

from engine.cache.chunks import ChunkTable
from engine.cache.policy import CostModel, Policy
from engine.cache.returns import EDGES, Returns
from engine.persistence import LocalClock


def learned(p: float, mean_gap: float, turns: int = 4000, seed: int = 0) -> Returns:
    """Turn ends of which a share p come back after an exponential gap."""
    rng = random.Random(seed)
    r = Returns()
    for _ in range(turns):
        r.ended()
        if rng.random() < p:
            r.returned(rng.expovariate(1 / mean_gap))
    return r


def test_the_share_of_returns_and_the_gaps_are_learned() -> None:
    r = learned(p=0.6, mean_gap=60.0)
    assert r.ready
    assert abs(r.p - 0.6) < 0.05
    # Just after a turn: it comes back with chance p, in about the mean gap
    assert abs(r.density(0.0) - 0.6 / 60.0) < 0.2 * 0.6 / 60.0


def test_the_density_only_falls_with_idle_time_and_is_zero_past_every_gap() -> None:
    r = learned(p=0.6, mean_gap=60.0)
    values = [r.density(t) for t in EDGES]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
    assert values[0] > 0
    assert r.density(max(r.gaps) * 2) == 0.0
    # Exponential gaps: after 5 mean gaps idle it is far less likely to be a live conversation
    assert r.density(300.0) < 0.05 * r.density(0.0)


def test_not_ready_before_enough_gaps() -> None:
    r = Returns(min_seen=64)
    for _ in range(63):
        r.ended()
        r.returned(10.0)
    assert not r.ready
    r.returned(10.0)
    assert r.ready


def policy(kind: str, returns: Returns, last: dict[str, float]) -> Policy:
    clock = LocalClock(now=lambda: 0.0)
    for cid, t in last.items():
        clock.touch(cid, t)
    p = Policy(kind, CostModel([4, 64], [1.0, 16.0], 0.0), 4, clock)
    p.returns = returns
    return p


def test_a_long_idle_conversation_goes_before_a_recent_one_even_when_dearer() -> None:
    # 300 s idle with 60 s gaps: probably ended. The paper's value keeps its chunk 15 (14x the
    # cost of a chunk 0) over the chunk 0 of a conversation idle 40 s; the learned one does not.
    r = learned(p=0.5, mean_gap=60.0)
    now = 1000.0
    last = {"old": now - 300.0, "recent": now - 40.0}
    paper, learned_ = policy("pensieve", r, last), policy("returns", r, last)
    old, recent = (ChunkTable("old"), 15), (ChunkTable("recent"), 0)
    assert paper.key(*old, now) > paper.key(*recent, now)
    assert learned_.key(*old, now) < learned_.key(*recent, now)


def test_past_the_longest_gap_the_oldest_goes_first() -> None:
    r = learned(p=0.5, mean_gap=10.0)
    now = 10_000.0
    last = {"older": 0.0, "old": 5000.0}
    p = policy("returns", r, last)
    assert p.key(ChunkTable("older"), 1, now) < p.key(ChunkTable("old"), 1, now)


def test_before_it_has_learned_it_is_the_papers_value() -> None:
    r = Returns()
    last = {"a": 990.0}
    a, b = policy("returns", r, last), policy("pensieve", r, last)
    assert a.value(ChunkTable("a"), 2, 1000.0) == b.value(ChunkTable("a"), 2, 1000.0)
