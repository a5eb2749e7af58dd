"""The scheduler and the engine talk in values: a waiting turn without the history its dropped
chunks need is not admitted, and the plan names the read; it is admitted once the history
is on the turn, and fails alone when the read failed or found the history short."""

from __future__ import annotations

from engine.cache.manager import KVCacheManager
from engine.cache.policy import CostModel, Policy
from engine.persistence import LocalClock
from engine.plan import Read
from engine.request import Request, Status
from engine.scheduler import Scheduler
from engine.stream import StreamState
from engine.types import Turn, TurnStats

CS = 4


def setup(gpu: int = 16) -> tuple[Scheduler, KVCacheManager]:
    clock = LocalClock(now=lambda: 1000.0)
    policy = Policy("pensieve", CostModel.linear(CS, 1024), CS, clock)
    cache = KVCacheManager(gpu, 0, CS, policy, "gpu", now=lambda: 1000.0)
    return Scheduler(cache, 64, 8, now=lambda: 1000.0), cache


def restarted(sched: Scheduler, cache: KVCacheManager, cid: str, context: int) -> Request:
    """A turn of a conversation whose `context` tokens are all dropped (as after a
    restart): its recompute needs their history."""
    table = cache.table(cid)
    cache.reset(table, context)
    state = StreamState(cid, length=context, kv_len=context)
    req = Request(Turn(cid, [1, 2]), state, table, seq=0, base=context, tokens=[1, 2],
                  stats=TurnStats())  # fmt: skip
    sched.add(req)
    return req


def test_a_turn_without_its_history_waits_and_the_plan_names_the_read() -> None:
    sched, cache = setup()
    req = restarted(sched, cache, "a", 8)
    plan = sched.schedule()
    assert plan.reads == [Read(req, 0)] and not plan.pieces
    assert req.status == Status.WAITING
    req.prefix, req.read_for = list(range(8)), 0  # what the engine's read puts on the turn
    plan = sched.schedule()
    assert not plan.reads and req.status == Status.RUNNING
    assert [(p.start, p.end) for p in plan.pieces] == [(0, 8), (8, 10)]  # recompute, prompt


def test_a_read_in_flight_is_not_asked_for_again() -> None:
    sched, cache = setup()
    req = restarted(sched, cache, "a", 8)
    req.fetch = object()  # started by the engine, not finished
    plan = sched.schedule()
    assert not plan.reads and not plan.pieces and req.status == Status.WAITING


def test_a_failed_or_short_read_fails_that_turn_alone() -> None:
    sched, cache = setup()
    failed = restarted(sched, cache, "a", 8)
    short = restarted(sched, cache, "b", 8)
    ok = restarted(sched, cache, "c", 4)
    failed.error = OSError("the database refused")
    short.prefix, short.read_for = list(range(5)), 0  # read, and the history had 5 tokens
    ok.prefix, ok.read_for = list(range(4)), 0
    plan = sched.schedule()
    assert plan.failed == [failed, short]
    assert "has 5 tokens, 8 are needed" in str(short.error)
    assert ok.status == Status.RUNNING and not plan.reads
