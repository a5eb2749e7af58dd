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


def agent_step_over_a_chat(gpu_chunks: int) -> tuple[list[int], list[int], int]:
    """A chat decodes; an agent's tool result (an earlier job, a later arrival) needs room."""
    clock = [100.0]
    config = EngineConfig(model="dummy:tiny", device="cpu", gpu_cache_chunks=gpu_chunks,
                          cpu_cache_chunks=64, max_batch_tokens=256, chunk_size=32)  # fmt: skip
    engine = Engine(config, now=lambda: clock[0])
    sampling = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    send(engine, "agent", 60)
    engine.tools_called("agent", ["search"])
    clock[0] = 110.0
    chat = engine.submit(Turn("chat", [(i % 150) + 20 for i in range(60)], sampling))
    engine.step()
    clock[0] = 120.0
    step = engine.submit(Turn("agent", [(i % 100) + 30 for i in range(40)], sampling))
    assert step.rank < chat.rank and step.seq > chat.seq
    while chat.status != Status.FINISHED or step.status != Status.FINISHED:
        engine.step()
    engine.flush()
    return chat.output, step.output, engine.snapshot().counters.suspensions


def test_a_later_ranked_turn_planned_first_in_a_step_is_suspended_whole() -> None:
    """The suspension's victim is the latest-ranked turn, but a step plans running turns by
    arrival: the chat's token was planned before the agent's growth needed its room. Its
    planned piece leaves the step with it (it ran on blocks swapped out: the engine
    stopped, 'chunks off the GPU while running'), and both replies are as unpressured."""
    chat, step, none = agent_step_over_a_chat(64)
    assert none == 0
    for gpu in (7, 9):
        got_chat, got_step, suspensions = agent_step_over_a_chat(gpu)
        assert suspensions >= 1
        assert (got_chat, got_step) == (chat, step)


def test_a_suspended_turn_waits_behind_the_steps_of_earlier_jobs() -> None:
    from engine.plan import StepPlan

    sched, cache = scheduler(gpu=8)  # two 3-chunk contexts at a time
    chat = turn(sched, cache, "chat", 0, rank=20.0)
    agent = turn(sched, cache, "agent", 1, rank=10.0)
    sched.schedule()
    assert chat.status == agent.status == Status.RUNNING
    other = turn(sched, cache, "other", 2, rank=15.0)  # a step of a job begun before the chat
    sched._suspend(chat, StepPlan())  # as `_room` suspends the latest-ranked for room
    assert list(sched.waiting) == [other, chat]
