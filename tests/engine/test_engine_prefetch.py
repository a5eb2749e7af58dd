"""Typing-aware prefetch in the engine: a conversation pushed to the CPU tier and one whose
prefix was dropped are brought back before their next turn, which then finds its context
on the GPU tier (prefetched_tokens > 0) and answers exactly as without prefetch and as
Hugging Face transformers; a turn that arrives while the prefetch runs takes it over."""

from __future__ import annotations

import random
import time

import pytest

from engine import Engine, EngineConfig, SamplingParams, Turn
from engine.request import PrefetchEnd
from tests.devices import DEVICES
from tests.oracle import hf_greedy, hf_model

SP = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    return [[rng.randrange(5, 5000) for _ in range(n)] for n in (150, 300, 10)]


def tight_engine(
    cpu: int,
    max_batch_tokens: int = 2048,
    tp: int = 1,
    share: float | None = None,
    device: str = "cpu",
) -> Engine:
    """dummy:tiny with a GPU tier of 12 chunks: two 150-300 token conversations overflow it."""
    return Engine(
        EngineConfig(
            model="dummy:tiny",
            device=device,
            dtype="float32",
            gpu_cache_chunks=12,
            cpu_cache_chunks=cpu,
            max_batch_tokens=max_batch_tokens,
            tensor_parallel=tp,
            prefetch_share=share,
        )
    )


def replay(
    prompts,
    cpu: int,
    prefetch: str | None,
    max_batch_tokens: int = 2048,
    tp: int = 1,
    device: str = "cpu",
):
    """a's first turn, then b's pushes a off the GPU tier (to the CPU, or dropped when
    there is no CPU tier); b is deleted (room for a recompute); a's second turn, after a
    prefetch run to completion ("full"), after one step of it ("step"), or none."""
    a1, b1, a2 = prompts
    engine = tight_engine(cpu, max_batch_tokens, tp, device=device)
    first = engine.run([Turn("a", a1, SP)])[0]
    engine.run([Turn("b", b1, SP)])
    time.sleep(0.02)  # b idle for a moment: worth less than a once a's user types
    before = engine.cache.tables["a"].tiers()
    if cpu == 0:
        engine.free("b")
    if prefetch:
        engine.prefetch("a")
        engine.prefetch("a")  # repeated typing frames are one prefetch
        engine.step()
        while prefetch == "full" and engine.has_work():
            engine.step()
        engine.cache.check()
    after = engine.cache.tables["a"].tiers()
    second = engine.run([Turn("a", a2, SP)])[0]
    engine.cache.check()
    context = a1 + first.token_ids + a2
    return before, after, second, context, engine


# On CUDA the swap-in prefetch runs on the copy stream and the recompute on the compute one.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cpu", [32, 0], ids=["cpu-tier", "dropped"])
def test_prefetched_context_is_found_on_the_gpu(prompts, cpu, device):
    before, _, plain, _, _ = replay(prompts, cpu, None, device=device)
    assert ("cpu" if cpu else "dropped") in before
    assert plain.stats.prefetched_tokens == 0
    _, after, got, context, engine = replay(prompts, cpu, "full", device=device)
    assert after == ["gpu"] * len(after)
    s = got.stats
    assert s.prefetched_tokens > 0 and s.swapped_in_tokens == s.recomputed_tokens == 0
    assert s.cached_tokens == len(context) - len(prompts[2]) - 1  # the last reply token
    assert engine.snapshot().counters.prefetched_tokens >= s.prefetched_tokens
    assert got.token_ids == plain.token_ids
    if cpu == 0:  # the recomputed KV is right: Hugging Face on the whole context
        hf = hf_model(engine).to(device)
        assert got.token_ids == hf_greedy(hf, context, 4, set(), device=device)


@pytest.mark.timeout(300)
def test_prefetch_under_tensor_parallelism(prompts):
    """A swap-in prefetch runs as a step without a forward: the other rank must bring its
    share of the KV in too, or the next turn reads stale blocks there."""
    _, _, plain, _, _ = replay(prompts, 32, None)
    _, after, got, _, engine = replay(prompts, 32, "full", tp=2)
    try:
        assert after == ["gpu"] * len(after)
        assert got.stats.prefetched_tokens > 0
        assert got.token_ids == plain.token_ids
    finally:
        engine.close()


def test_a_turn_takes_over_a_running_prefetch(prompts):
    _, _, plain, _, _ = replay(prompts, 0, None, max_batch_tokens=64)
    _, _, got, _, engine = replay(prompts, 0, "step", max_batch_tokens=64)
    s = got.stats  # 64 of the 128 dropped positions were recomputed when the turn came
    assert s.prefetched_tokens == 64 and s.recomputed_tokens == 128 - 64
    assert got.token_ids == plain.token_ids
    assert not engine.has_work()


def test_no_op_cases(prompts):
    engine = Engine(EngineConfig(model="dummy:tiny", device="cpu", gpu_cache_chunks=12))
    engine.prefetch("unknown")
    req = engine.submit(Turn("a", prompts[2], SP))
    engine.prefetch("a")  # busy: its own turn brings the context
    assert not engine.scheduler.prefetch.queue and not engine.scheduler.prefetch.swaps
    while req.status != "finished":
        engine.step()
    engine.prefetch("a")  # all on the GPU already
    assert not engine.has_work()
    gpu = Engine(EngineConfig(model="dummy:tiny", device="cpu", cache_mode="gpu"))
    gpu.run([Turn("a", prompts[2], SP)])
    gpu.prefetch("a")
    assert not gpu.has_work()


def test_typing_protects_the_context_until_the_turn(prompts):
    """A typing hint marks the conversation's turn as expected (its chunks are the last idle
    ones to go), even when its context is all on the GPU already; the turn ends it."""
    engine = Engine(EngineConfig(model="dummy:tiny", device="cpu", gpu_cache_chunks=12))
    engine.run([Turn("a", prompts[2], SP)])
    engine.prefetch("a")
    assert "a" in engine.cache.policy.expected and not engine.has_work()
    engine.run([Turn("a", prompts[2], SP)])
    assert "a" not in engine.cache.policy.expected
    engine.prefetch("a")
    engine.free("a")
    assert not engine.cache.policy.expected


def test_a_waiting_turn_takes_the_room_of_a_running_prefetch(prompts):
    """A turn that does not fit beside a running recompute prefetch ends the prefetch (its
    context goes back to idle) and runs, exactly as on its own; the user's next typing
    frame starts a new prefetch."""
    a1, b1, _ = prompts
    engine = tight_engine(cpu=0, max_batch_tokens=64)
    engine.run([Turn("a", a1, SP)])
    engine.run([Turn("b", b1, SP)])
    engine.free("b")
    engine.prefetch("a")
    engine.step()
    running = engine.scheduler.prefetch.current["a"]
    assert running.status == "running" and running.pending  # still recomputing a's prefix
    c = [t + 1 for t in b1]  # 10 chunks: more than the tier has beside a's pinned context
    assert not engine.cache.can_admit(engine.cache.table("c"), len(c))
    req = engine.submit(Turn("c", c, SP))
    engine.step()
    assert running.status == "finished" and running.prefetch_end == PrefetchEnd.SUSPENDED
    assert running.finish_reason is None  # a prefetch has no public finish reason
    assert req.status == "running"
    while req.status != "finished":
        engine.step()
    engine.cache.check()
    assert req.output == hf_greedy(hf_model(engine), c, 4, set())
    engine.prefetch("a")  # the user types again: a new prefetch
    assert engine.scheduler.prefetch.current["a"] is not running
    assert engine.has_work()


@pytest.mark.parametrize("share", [None, 0.25])
def test_prefetch_share_of_steps_with_real_turns(prompts, share):
    """With no share (the CPU's default: every token costs its compute) a recompute
    prefetch waits while a real turn runs and goes once none does, at most
    `prefetch_step_tokens` (4 chunks on the CPU) a step; with a share it runs beside the
    turn, at most that share of the step's tokens."""
    _, b1, c = prompts
    a = [t + 7 for t in b1[:250]]  # 8 chunks: b's 10 drop most of them
    engine = tight_engine(cpu=0, max_batch_tokens=256, share=share)
    engine.run([Turn("a", a, SP)])
    engine.run([Turn("b", b1, SP)])
    engine.free("b")
    assert engine.cache.recompute_tokens(engine.cache.tables["a"], len(a) + 4) > 128
    req = engine.submit(Turn("c", c, SamplingParams(max_tokens=8, ignore_eos=True)))
    engine.step()  # c's prompt
    engine.prefetch("a")
    pf = engine.scheduler.prefetch.current["a"]
    engine.step()  # a decode step of c
    assert req.status == "running"
    if share is None:
        assert pf.status == "waiting"
        while req.status != "finished":
            engine.step()
        assert pf.status == "waiting"
        engine.step()  # no real turn: the prefetch starts, 4 chunks a step
        assert pf.status == "running" and pf.pending[0][0] == 128
    else:
        assert pf.status == "running" and pf.pending[0][0] == 64  # a quarter of 256
    while pf.status == "running" or req.status == "running":
        engine.step()
    assert pf.prefetch_end == PrefetchEnd.DONE and engine.cache.tables["a"].n_dropped == 0
    engine.cache.check()


def test_fail_all_ends_prefetches_and_turns(prompts):
    """A failed step ends everything in flight: the real turns with "error" (the only ones
    returned), the running prefetch too; nothing is left pinned or queued, and both
    conversations take turns again."""
    a1, b1, c = prompts
    engine = tight_engine(cpu=0, max_batch_tokens=64)
    engine.run([Turn("a", a1, SP)])
    engine.run([Turn("b", b1, SP)])
    engine.free("b")
    engine.prefetch("a")
    engine.step()
    pf = engine.scheduler.prefetch.current["a"]
    assert pf.status == "running"
    req = engine.submit(Turn("c", c, SP))
    error = RuntimeError("a step failed")
    assert engine.fail_all(error) == [req]
    assert req.finish_reason == "error" and req.error is error
    assert pf.prefetch_end == PrefetchEnd.FAILED and pf.finish_reason is None
    assert not engine.has_work() and not engine.scheduler.prefetch.current
    engine.cache.check()
    again = engine.run([Turn("a", [5, 6], SP), Turn("c", c, SP)])
    assert [r.finish_reason for r in again] == ["length", "length"]
    engine.cache.check()
