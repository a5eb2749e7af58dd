"""Waiting turns are admitted by job: a turn that carries a tool's result ranks with the turn
that began its agent loop; any other turn ranks by its arrival, equal ranks keep their
order, and a turn that did not follow a tool call begins a new job."""

from __future__ import annotations

from engine import Engine, EngineConfig, SamplingParams, Turn
from engine.cache.manager import KVCacheManager
from engine.cache.policy import CostModel, Policy
from engine.persistence import LocalClock
from engine.request import Request, Status
from engine.scheduler import Scheduler
from engine.stream import StreamState
from engine.types import TurnStats

CS = 4


def scheduler(gpu: int) -> tuple[Scheduler, KVCacheManager]:
    clock = LocalClock(now=lambda: 1000.0)
    policy = Policy("pensieve", CostModel.linear(CS, 1024), CS, clock)
    cache = KVCacheManager(gpu, 0, CS, policy, "gpu", now=lambda: 1000.0, admit_reserve=0.0)
    return Scheduler(cache, 64, 8, now=lambda: 1000.0), cache


def turn(sched: Scheduler, cache: KVCacheManager, cid: str, seq: int, rank: float) -> Request:
    tokens = list(range(10, 22))  # 3 chunks
    req = Request(Turn(cid, tokens), StreamState(cid), cache.table(cid), seq=seq, base=0,
                  tokens=tokens, stats=TurnStats(), prefix=[], rank=rank)  # fmt: skip
    sched.add(req)
    return req


def test_waiting_turns_queue_by_rank_and_equal_ranks_keep_their_order() -> None:
    sched, cache = scheduler(gpu=64)
    a = turn(sched, cache, "a", 0, rank=5.0)
    b = turn(sched, cache, "b", 1, rank=3.0)  # a tool's result of a job begun at 3
    c = turn(sched, cache, "c", 2, rank=3.0)
    d = turn(sched, cache, "d", 3, rank=9.0)
    assert list(sched.waiting) == [b, c, a, d]


def test_room_for_one_goes_to_the_earlier_job() -> None:
    sched, cache = scheduler(gpu=4)  # one 3-chunk context at a time
    chat = turn(sched, cache, "chat", 0, rank=20.0)  # came first, after the job began
    agent = turn(sched, cache, "agent", 1, rank=10.0)
    sched.schedule()
    assert agent.status == Status.RUNNING and chat.status == Status.WAITING


def make(job_order: bool = True) -> tuple[Engine, list[float]]:
    clock = [100.0]
    config = EngineConfig(model="dummy:tiny", device="cpu", gpu_cache_chunks=12,
                          cpu_cache_chunks=4, max_batch_tokens=64, job_order=job_order)  # fmt: skip
    return Engine(config, now=lambda: clock[0]), clock


def send(engine: Engine, cid: str, n: int) -> Request:
    sampling = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    req = engine.submit(Turn(cid, [(i % 200) + 10 for i in range(n)], sampling))
    while req.status != Status.FINISHED:
        engine.step()
    engine.flush()
    return req


def test_a_tools_result_goes_on_with_its_job_and_a_new_message_begins_one() -> None:
    engine, clock = make()
    first = send(engine, "agent", 20)
    assert first.rank == 100.0
    engine.tools_called("agent", ["search"])
    clock[0] = 130.0
    step = send(engine, "agent", 5)  # the tool's result
    assert step.rank == 100.0
    clock[0] = 170.0
    answer = send(engine, "agent", 5)  # no tool was called: a person's next message
    assert answer.rank == 170.0


def test_without_job_order_turns_rank_by_arrival() -> None:
    engine, clock = make(job_order=False)
    send(engine, "agent", 20)
    engine.tools_called("agent", ["search"])
    clock[0] = 130.0
    assert send(engine, "agent", 5).rank == 130.0
