"""Retention through the engine: a turn's pin, checked against its owner's cap when the
turn is accepted, run from its end, shown in the snapshot, let go on delete; a disk
retention keeps the conversation's files; a turn that ended in tool calls waits for them."""

from __future__ import annotations

import time

import pytest

from engine import Engine, EngineConfig, SamplingParams, Turn
from engine.cache.pins import PinRefused
from engine.request import Status
from engine.types import Retention


def make(now=None, **kw) -> Engine:
    config = dict(device="cpu", gpu_cache_chunks=12, cpu_cache_chunks=4, max_batch_tokens=64)
    config.update(kw)
    return Engine(EngineConfig(model="dummy:tiny", **config), now=now)


def ask(engine: Engine, cid: str, n: int, retention: Retention | None = None, seed: int = 0):
    prompt = [(seed * 7 + i) % 200 + 10 for i in range(n)]
    sampling = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    return engine.run([Turn(cid, prompt, sampling, retention=retention)])[0]


def test_a_pin_holds_the_conversation_and_shows_in_the_snapshot():
    engine = make()
    ask(engine, "agent", 60, Retention(ttl_s=600, owner="alice"))
    for k in range(9):  # other chats push everything else out of memory
        ask(engine, f"chat{k}", 60, seed=k + 1)
    snap = engine.snapshot()
    agent = next(c for c in snap.conversations if c.id == "agent")
    assert "dropped" not in agent.chunks
    assert snap.counters.dropped_tokens > 0  # others were dropped meanwhile
    assert snap.pins.conversations == 1
    assert snap.pins.gpu_bytes + snap.pins.cpu_bytes > 0
    assert snap.to_dict()["pins"]["conversations"] == 1
    engine.free("agent", erase=True)  # deleted: the pin goes at once
    assert engine.snapshot().pins.conversations == 0


def test_a_pin_past_the_owner_cap_is_refused_before_anything_runs():
    engine = make()
    per_chunk = engine.pool.bytes_per_chunk
    cap = 3 * per_chunk
    ask(engine, "a1", 60, Retention(ttl_s=600, owner="alice", cap_bytes=cap))  # 2 chunks
    with pytest.raises(PinRefused, match="over the cap"):
        ask(engine, "a2", 60, Retention(ttl_s=600, owner="alice", cap_bytes=cap))
    assert "a2" not in engine.claims  # refused at once, nothing queued
    ask(engine, "b1", 60, Retention(ttl_s=600, owner="bob", cap_bytes=cap))
    assert engine.snapshot().pins.conversations == 2


def test_a_restarted_engine_takes_its_pins_back_in_wall_time():
    engine = make()
    cap = 3 * engine.pool.bytes_per_chunk
    ask(engine, "a1", 60, Retention(ttl_s=600, priority=70, owner="alice", cap_bytes=cap))
    kept = engine.retained("a1")
    assert kept.until == pytest.approx(time.time() + 600, abs=5)  # wall time
    assert kept.bytes == 2 * engine.pool.bytes_per_chunk and kept.priority == 70
    assert engine.retained("never") is None

    clock = [5.0]  # a new engine whose clock starts anew (a virtual one, say)
    again = make(now=lambda: clock[0])
    assert again.restore_retention([kept]) == 1
    pins = again.cache.policy.pins
    assert pins.held("a1", 5.0 + 590) and not pins.held("a1", 5.0 + 610)
    assert again.snapshot().pins.conversations == 1
    with pytest.raises(PinRefused, match="over the cap"):  # 2 chunks held + 2 asked > 3
        ask(again, "a2", 60, Retention(ttl_s=600, owner="alice", cap_bytes=cap))
    again.free("a1", erase=True)  # deleted: the restored pin goes like any
    ask(again, "a2", 60, Retention(ttl_s=600, owner="alice", cap_bytes=cap))


def test_bad_retention_is_refused():
    engine = make()
    with pytest.raises(ValueError, match="retention.priority"):
        ask(engine, "x", 8, Retention(ttl_s=10, priority=101))
    with pytest.raises(ValueError, match="disk tier"):
        ask(engine, "x", 8, Retention(disk_s=86400))


def test_a_disk_retention_keeps_the_conversation_files(tmp_path):
    engine = make(disk_cache_dir=str(tmp_path))
    ask(engine, "kept", 70, Retention(disk_s=86400))
    engine.disk.flush()
    hashes = engine.streams["kept"].hashes
    assert hashes and all(engine.disk.store.kept[h] > engine.disk.store.now() for h in hashes)
    assert all(engine.disk.store.has(h, j) for j, h in enumerate(hashes))


def test_a_turn_ending_in_tool_calls_waits_and_the_next_turn_teaches_the_gap():
    engine = make()
    ask(engine, "agent", 20)
    engine.tools_called("agent", ["search"])
    assert engine.cache.policy.tools.is_waiting("agent")
    ask(engine, "agent", 5)
    assert not engine.cache.policy.tools.is_waiting("agent")
    assert len(engine.cache.policy.tools.gaps["search"]) == 1


def test_a_queued_turn_is_the_last_idle_to_go_until_it_ends():
    """A turn waiting for admission is about to run: its conversation's chunks sort after
    every idle one (by idle time alone, `returns` would value it as an idle chat), and
    only until its turn ends."""
    engine = make(eviction="returns")
    ask(engine, "queued", 40)
    ask(engine, "idle", 40, seed=1)
    policy = engine.cache.policy
    for _ in range(64):  # people come back in about a minute: `returns` is ready
        policy.returns.ended()
        policy.returns.returned(60.0)
    sampling = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    req = engine.submit(Turn("queued", [11, 12, 13], sampling))
    now = engine.now()
    queued, idle = engine.cache.table("queued"), engine.cache.table("idle")
    assert policy.key(queued, 0, now) > policy.key(idle, 0, now)
    while engine.has_work():
        engine.step()
    engine.flush()
    assert req.status == Status.FINISHED
    assert not policy.is_expected("queued", engine.now())


def test_tool_gaps_are_learned_apart_from_people_gaps():
    """`returns` learns how long people take to answer; a tool's result arriving is a tool's
    gap, learned per tool, and its turn end is not counted among those a person may follow."""
    engine = make()
    returns = engine.cache.policy.returns
    ask(engine, "agent", 20)
    ends = returns.ends
    engine.tools_called("agent", ["search"])
    engine.tools_called("agent", ["search"])  # said twice: counted once
    assert returns.ends == ends - 1
    ask(engine, "agent", 5)
    assert len(returns.gaps) == 0 and len(engine.cache.policy.tools.gaps["search"]) == 1
    ask(engine, "agent", 5)  # a person's answer this time
    assert len(returns.gaps) == 1


def test_an_admission_short_of_room_waits_instead_of_failing_the_step(monkeypatch):
    """Where pins hold more blocks than admission foresaw, the turn waits (the step goes
    on, what was evicted is still copied) and runs once the pins let go."""
    engine = make()
    for k in range(4):  # 3 chunks each: 12 pinned chunks in a 12 + 4 chunk cache
        ask(engine, f"agent{k}", 90, Retention(ttl_s=600, owner="alice"), seed=k)
    monkeypatch.setattr(engine.cache, "can_admit", lambda t, upto: True)
    sampling = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    req = engine.submit(Turn("chat", [(7 * i) % 200 + 10 for i in range(200)], sampling))
    engine.step()
    assert req.status == Status.WAITING
    engine.cache.check()
    monkeypatch.undo()
    for k in range(4):
        engine.unpin(f"agent{k}")
    while engine.has_work():
        engine.step()
    engine.flush()
    assert req.status == Status.FINISHED
    engine.cache.check()


def test_a_tool_wait_is_held_for_the_gaps_seen_and_let_go_when_its_next_turn_ends():
    engine = make(tool_holds=True)
    pins = engine.cache.policy.pins
    ask(engine, "agent", 20)
    for k in range(4):  # four tool gaps seen: what holds are sized by
        engine.tools_called("agent", ["search"])
        ask(engine, "agent", 5, seed=k)
    engine.tools_called("agent", ["search"])
    hold, since = engine.cache.policy.tools.hold_s(), engine.streams["agent"].idle_since
    assert hold is not None and pins.held("agent", since)
    assert pins.holds["agent"] == pytest.approx(since + hold)
    ask(engine, "agent", 5)
    assert not pins.held("agent", engine.now())
    assert engine.snapshot().pins.conversations == 0  # a hold is not a client's pin


def test_no_tool_wait_is_held_unless_asked():
    engine = make()
    ask(engine, "agent", 20)
    for k in range(5):
        engine.tools_called("agent", ["search"])
        ask(engine, "agent", 5, seed=k)
    engine.tools_called("agent", ["search"])
    assert engine.cache.policy.tools.hold_s() is not None
    assert not engine.cache.policy.pins.held("agent", engine.streams["agent"].idle_since)


def test_a_tool_wait_is_expected_back_within_the_prior_before_gaps_are_learned():
    """Before any tool gap is learned a waiting agent is expected back within PRIOR_S (kept
    over idle chats meanwhile); once gaps are, within their 90th percentile."""
    from engine.cache.toolwait import PRIOR_S

    clock = [100.0]
    engine = make(now=lambda: clock[0])
    policy = engine.cache.policy
    ask(engine, "agent", 20)
    engine.tools_called("agent", ["search"])
    assert policy.is_expected("agent", 100.0 + PRIOR_S - 0.5)
    assert not policy.is_expected("agent", 100.0 + PRIOR_S + 0.5)
    for _ in range(4):  # four 2 s tool gaps learned
        clock[0] += 2.0
        ask(engine, "agent", 5)
        engine.tools_called("agent", ["search"])
    since = clock[0]
    assert policy.tools.expect_s() == 2.0
    assert policy.is_expected("agent", since + 1.5) and not policy.is_expected("agent", since + 2.5)


def test_no_tool_wait_is_expected_without_the_tool_value():
    engine = make(tool_value=False)
    ask(engine, "agent", 20)
    engine.tools_called("agent", ["search"])
    assert not engine.cache.policy.is_expected("agent", engine.now())
