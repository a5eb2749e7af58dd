"""The tool-aware eviction value: a conversation waiting for a tool is kept as long as the
tool is expected back, learned per tool name from the gaps seen, and no longer."""

from __future__ import annotations

from engine.cache.chunks import ChunkTable
from engine.cache.policy import CostModel, Policy
from engine.cache.toolwait import ToolWaits
from engine.persistence import LocalClock

CS = 32


def policy(now: float) -> Policy:
    p = Policy("pensieve", CostModel.linear(CS, 4096), CS, LocalClock(now=lambda: now))
    for k in range(8):  # `search` came back in about 2 s, `build` in about 10 minutes
        p.tools.wait(f"s{k}", ["search"], since=0.0)
        p.tools.arrived(f"s{k}", 1.5 + k / 8)
        p.tools.wait(f"b{k}", ["build"], since=0.0)
        p.tools.arrived(f"b{k}", 540.0 + 15 * k)
    return p


def test_remaining_is_learned_per_tool_and_ends_past_every_gap_seen():
    w = policy(0.0).tools
    w.wait("a", ["search"], since=0.0)
    assert 1.5 < w.remaining("a", 0.0) < 2.5  # mean of the gaps seen
    assert w.remaining("a", 1.9) < w.remaining("a", 0.0)  # less to wait once waited
    assert w.remaining("a", 10.0) is None  # outlasted every gap: an idle chat again
    w.wait("b", ["search", "build"], since=0.0)  # back when the slowest is
    assert w.remaining("b", 0.0) > 500
    assert ToolWaits().remaining("a", 0.0) is None  # nothing learned: no opinion


def test_an_agent_on_a_short_tool_outlives_an_idle_chat_of_the_same_cost():
    now = 1000.0
    p = policy(now)
    clock = p.clock
    for cid in ("agent", "chat", "slow"):
        clock.touch(cid, now - 1.0)  # all three ended their turn 1 s ago, same context
    p.tools.wait("agent", ["search"], since=now - 1.0)
    p.tools.wait("slow", ["build"], since=now - 1.0)
    agent, chat, slow = (p.key(ChunkTable(c), 4, now) for c in ("agent", "chat", "slow"))
    assert chat < agent  # the chat goes first: the agent is back in about a second
    assert slow == chat  # a 10-minute tool is worth no more than an idle chat
    # The short tool overran every gap seen (a hung call): it counts as an idle chat again.
    late = now + 30.0
    assert p.key(ChunkTable("agent"), 4, late) == p.key(ChunkTable("chat"), 4, late)


def test_the_next_turn_ends_the_wait_and_teaches_the_gap():
    p = policy(0.0)
    p.tools.wait("a", ["lookup"], since=0.0)
    assert p.tools.remaining("a", 0.0) is not None  # a tool seen rarely: every tool's gaps
    p.tools.arrived("a", 3.0)
    assert not p.tools.is_waiting("a")
    assert list(p.tools.gaps["lookup"]) == [3.0]
