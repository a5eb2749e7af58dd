"""Clients' pins and priorities in the eviction order: pinned chunks stay in memory while
others are evicted, until the pin expires; a cap per owner; a finished session goes first."""

from __future__ import annotations

import pytest

from engine.cache.pins import PinRefused, Pins, Retained
from tests.engine.cache.test_cache import manager, turn


def pin(m, cid: str, ttl_s: float, now: float, owner: str = "alice", priority: int = 50) -> None:
    m.policy.pins.reserve(cid, owner, ttl_s, priority, 0, None, now)


def test_a_pinned_conversation_keeps_its_chunks_while_others_are_evicted():
    m, clock, now = manager(gpu=6, cpu=3)
    turn(m, clock, "agent", 12, when=900.0)  # 3 chunks, idle for 100 s: the paper drops it first
    pin(m, "agent", 600.0, now())
    turn(m, clock, "chat", 12, when=999.0)  # 3 chunks, idle for 1 s
    turn(m, clock, "third", 16, when=1000.0)  # 4 chunks: 4 must leave the GPU, 1 the memory
    # The agent's chunks moved to the CPU (allowed), none dropped; the recent chat paid.
    assert "dropped" not in m.table("agent").tiers()
    assert m.table("chat").tiers()[0] == "dropped"
    assert m.counters.dropped_tokens > 0


def test_pinned_chunks_are_never_dropped_to_make_room():
    m, clock, now = manager(gpu=4, cpu=0, mode="gpu")  # no CPU tier: pinned chunks stay put
    turn(m, clock, "agent", 12, when=900.0)
    pin(m, "agent", 600.0, now())
    m.begin_step()
    with pytest.raises(MemoryError):  # a turn that needs the pinned blocks is refused room
        m.admit(m.table("other"), 0, 8)
    assert m.table("agent").tiers() == ["gpu", "gpu", "gpu"]
    m.check()


def test_a_pin_expires():
    m, clock, now = manager(gpu=6, cpu=0, mode="gpu")
    turn(m, clock, "agent", 12, when=900.0)
    pin(m, "agent", 50.0, now())  # until 1050
    now.t = 1100.0
    turn(m, clock, "other", 16, when=1100.0)
    assert m.table("agent").tiers() == ["dropped", "gpu", "gpu"]


def test_a_finished_session_goes_first_and_priority_scales_the_value():
    m, clock, now = manager(gpu=6, cpu=0, mode="gpu")
    turn(m, clock, "done", 8, when=999.0)  # recent, but its client said it is done
    turn(m, clock, "idle", 8, when=900.0)
    m.policy.pins.finish("done")
    turn(m, clock, "new", 12, when=1000.0)  # needs 1 block more than free
    assert m.table("done").tiers()[0] == "dropped"
    assert m.table("idle").tiers() == ["gpu", "gpu"]
    low, high = m.policy.key(m.table("idle"), 1, 1000.0), None
    m.policy.pins.prioritize("idle", 100)
    high = m.policy.key(m.table("idle"), 1, 1000.0)
    assert high[2] == pytest.approx(2 * low[2])


def test_the_cap_per_owner_refuses_a_pin_and_leaves_others_alone():
    pins = Pins()
    pins.reserve("a1", "alice", 60, 50, 600, 1000, now=0.0)
    with pytest.raises(PinRefused, match="cap of 1000 bytes"):
        pins.reserve("a2", "alice", 60, 50, 600, 1000, now=0.0)
    pins.reserve("b1", "bob", 60, 50, 600, 1000, now=0.0)  # another owner's cap
    pins.reserve("a1", "alice", 60, 50, 900, 1000, now=0.0)  # its own pin again: replaced
    assert pins.held("a1", 1.0) and not pins.held("a2", 1.0) and pins.held("b1", 1.0)
    assert pins.owner_bytes("alice", 61.0) == 0  # expired pins hold nothing
    pins.reserve("a2", "alice", 60, 50, 600, 1000, now=61.0)
    pins.release("a2")
    assert not pins.held("a2", 62.0)


def test_a_pin_runs_from_the_end_of_each_turn():
    pins = Pins()
    pins.reserve("a", "alice", 60, 50, 100, None, now=0.0)
    pins.settle("a", now=50.0, size=64)
    assert pins.held("a", 109.0) and not pins.held("a", 111.0)
    assert pins.live(111.0) == {}


def test_what_the_pins_hold_is_read_out_and_put_back_after_a_restart():
    pins = Pins()
    pins.reserve("a1", "alice", 600, 80, 600, 1000, now=0.0)
    pins.settle("a1", now=10.0, size=700)  # held until 610
    pins.prioritize("low", 10)  # a priority, no pin
    pins.finish("over")  # a finished session
    pins.reserve("gone", "alice", 5, 50, 100, None, now=0.0)  # expired by 20
    kept = [pins.record(cid, now=20.0) for cid in ("a1", "low", "over", "gone", "never")]
    assert kept[0] == Retained("a1", "alice", 600, 610.0, 700, 80, False)
    assert kept[3:] == [None, None]  # nothing left to keep

    again = Pins()  # a new process
    assert again.restore([r for r in kept if r], now=20.0) == 1
    assert again.held("a1", 609.0) and not again.held("a1", 610.0)
    assert again.factor("a1") == 80 / 50 and again.factor("low") == 10 / 50
    assert again.factor("over") == 0.0 and not again.held("over", 20.0)
    assert again.owner_bytes("alice", 20.0) == 700  # counted against her cap
    with pytest.raises(PinRefused):  # 700 + 400 > 1000: fits only without the restored pin
        again.reserve("a2", "alice", 60, 50, 400, 1000, now=20.0)


def test_a_pin_that_expired_meanwhile_is_not_put_back_its_priority_is():
    pins = Pins()
    assert pins.restore([Retained("a", "alice", 60, 100.0, 500, 90)], now=100.0) == 0
    assert not pins.held("a", 100.0) and pins.live(100.0) == {}
    assert pins.owner_bytes("alice", 100.0) == 0
    assert pins.factor("a") == 90 / 50


def test_admission_counts_pinned_blocks_that_cannot_move():
    m, clock, now = manager(gpu=4, cpu=0, mode="gpu")
    turn(m, clock, "agent", 12, when=900.0)
    m.begin_step()
    assert m.can_admit(m.table("other"), 8)  # unpinned: its 3 blocks can be taken
    pin(m, "agent", 600.0, now())
    assert m.stuck_blocks() == 3
    assert not m.can_admit(m.table("other"), 8)  # the turn waits; the pin is not dropped
    assert m.can_admit(m.table("other"), 4)


def test_admission_counts_the_shared_chunks_a_pin_holds():
    # A pinned agent's first-prompt chunks, once published, are shared chunks of their own:
    # they cannot move either. Left out, admission let in a turn that then found no room.
    from engine.cache.sharing import chain_hashes

    m, clock, now = manager(gpu=5, cpu=0, share=True)
    turn(m, clock, "agent", 12, when=900.0)
    t = m.table("agent")
    m.publish(t, chain_hashes(list(range(12)), 4)[:2])
    assert t.n_shared == 2
    pin(m, "agent", 600.0, now())
    m.begin_step()
    assert m.stuck_blocks() == 3
    assert not m.can_admit(m.table("other"), 12)  # 3 blocks: only 2 are free
    assert m.can_admit(m.table("other"), 8)
    m.admit(m.table("other"), 0, 8)
    m.check()


def test_a_pin_that_expired_since_the_keys_were_taken_lets_its_chunks_go():
    # The eviction order keeps its keys for a while; a pin that ends in between still sorts
    # as pinned there. The evictor takes the keys again rather than refuse the room.
    m, clock, now = manager(gpu=4, cpu=0, mode="gpu")
    turn(m, clock, "agent", 12, when=now())  # 3 of the 4 blocks
    pin(m, "agent", 0.2, now())
    m.begin_step()  # the keys are taken while the pin holds
    now.t += 0.3  # it has expired; the keys are younger than the order's reorder time
    m.begin_step()
    m.admit(m.table("other"), 0, 8)  # 2 blocks: one of the agent's must go
    assert m.table("agent").tiers()[0] == "dropped"
    m.check()


def test_room_is_made_past_a_pinned_conversation_that_cannot_move():
    # Two pinned agents: "front" goes first in the order but has no CPU copy and the CPU
    # tier is full of pinned chunks; "backed" has CPU copies, its GPU blocks free at no
    # cost. The evictor passes over the first and takes the second's.
    m, clock, now = manager(gpu=8, cpu=2, swap_out_threshold=0.25)
    turn(m, clock, "backed", 8, when=900.0)  # 2 chunks
    turn(m, clock, "filler", 24, when=910.0)  # 6 chunks: the GPU is full
    assert len(m.swap_out_ahead().background) == 2  # backed's chunks copied to the CPU
    m.forget("filler")
    turn(m, clock, "front", 8, when=800.0)  # idle the longest: first in the order
    pin(m, "backed", 600.0, now())
    pin(m, "front", 600.0, now())
    m.begin_step()
    assert m.stuck_blocks() == 2  # front's: the CPU tier holds only pinned chunks
    assert m.can_admit(m.table("other"), 24)
    m.admit(m.table("other"), 0, 24)  # 6 blocks: 4 free and backed's 2
    assert m.table("front").tiers() == ["gpu", "gpu"]
    assert m.table("backed").tiers() == ["cpu", "cpu"]
    m.check()


def test_a_hold_keeps_a_tool_wait_until_it_ends_renewed_once_by_the_next_turn():
    pins = Pins()
    pins.hold("agent", until=10.0)
    assert pins.held("agent", 9.9) and not pins.held("agent", 10.0)
    assert pins.holding() == ["agent"] and pins.live(0.0) == {}  # not a client's pin
    pins.hold_queued("agent", now=9.0, hold_s=5.0)  # its next turn came: runs 5 s from then
    assert pins.held("agent", 13.9) and not pins.held("agent", 14.0)
    pins.hold_queued("late", now=9.0, hold_s=5.0)  # never held: nothing to renew
    assert not pins.held("late", 9.0)
    pins.unhold("agent")  # its turn ended
    assert not pins.held("agent", 9.0) and pins.holding() == []


def test_a_held_conversation_keeps_its_chunks_while_others_are_evicted():
    m, clock, now = manager(gpu=6, cpu=3)
    turn(m, clock, "agent", 12, when=900.0)  # 3 chunks, idle for 100 s: the paper drops it first
    m.policy.pins.hold("agent", now() + 5.0)
    turn(m, clock, "chat", 12, when=999.0)
    turn(m, clock, "third", 16, when=1000.0)
    assert "dropped" not in m.table("agent").tiers()
    assert m.table("chat").tiers()[0] == "dropped"
