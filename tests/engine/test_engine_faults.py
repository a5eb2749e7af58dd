"""Faults around the engine: a failed history read ends one turn, a full queue refuses with a
retry hint, a dead step loop is reported as such."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine import (
    AsyncEngine,
    Engine,
    EngineConfig,
    EngineOverloaded,
    MemoryHistory,
    SamplingParams,
    Turn,
)

SP = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPTS = {"ok1": list(range(10, 50)), "bad": list(range(60, 90)), "ok2": list(range(100, 145))}
SECOND = [7, 8, 9]


def config(**kw) -> EngineConfig:
    return EngineConfig(
        model="dummy:tiny", device="cpu", gpu_cache_chunks=32, cpu_cache_chunks=8, **kw
    )


class FailingHistory(MemoryHistory):
    """Raw history whose reads fail for one conversation, as a database error would."""

    def __init__(self, broken: str) -> None:
        super().__init__()
        self.broken = broken

    def read(self, conversation_id: str, start: int, end: int) -> list[int]:
        if conversation_id == self.broken:
            raise ConnectionError(f"history of {conversation_id} is unreachable")
        return super().read(conversation_id, start, end)


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, int], dict[str, list[int]], FailingHistory]:
    """Two turns of each conversation on an engine that keeps its own history: the second
    replies are what a restarted engine must give after recomputing the first turns."""
    normal = Engine(config())
    history = FailingHistory("bad")
    context, second = {}, {}
    for cid, prompt in PROMPTS.items():
        out = normal.run([Turn(cid, prompt, SP)])[0].token_ids
        history.append(cid, prompt + out)
        context[cid] = len(prompt + out)
    for r in normal.run([Turn(cid, SECOND, SP) for cid in PROMPTS]):
        second[r.conversation_id] = r.token_ids
    return context, second, history


def restarted_turns(context: dict[str, int]) -> list[Turn]:
    """The second turns as a restarted server sends them: the context comes from history."""
    return [Turn(cid, SECOND, SP, context_len=context[cid]) for cid in PROMPTS]


def test_failed_history_read_ends_that_turn_only(reference):
    context, second, history = reference
    engine = Engine(config(), history=history)
    reqs = [engine.submit(t) for t in restarted_turns(context)]
    steps = 0
    while engine.has_work():
        if not engine.step() and not engine.scheduler.running:
            engine.wait_for_io()
        steps += 1
        assert steps < 10_000
    by_id = {r.state.id: r for r in reqs}
    bad = by_id.pop("bad")
    assert bad.finish_reason == "error" and isinstance(bad.error, ConnectionError)
    assert bad.result().finish_reason == "error"
    for cid, req in by_id.items():
        assert req.finish_reason == "length" and req.error is None
        assert req.output == second[cid], cid
    assert not engine.scheduler.waiting and not engine.scheduler.running
    engine.cache.check()
    # The failed conversation is not stuck: once its history reads again, it goes on.
    history.broken = None
    again = engine.run([Turn("bad", SECOND, SP, context_len=context["bad"])])[0]
    assert again.finish_reason == "length" and again.token_ids == second["bad"]


def test_failed_history_read_through_the_async_engine(reference):
    context, second, history = reference

    async def main():
        engine = AsyncEngine(config(), history=history)
        await engine.start()
        try:
            streams = {t.conversation_id: engine.submit(t) for t in restarted_turns(context)}
            with pytest.raises(ConnectionError):
                async for _ in streams.pop("bad"):
                    pass
            for cid, stream in streams.items():
                tokens = [t async for t in stream]
                assert tokens == second[cid] and stream.result.finish_reason == "length"
            assert engine.alive
            assert not engine.is_busy("bad")  # it may be retried at once
        finally:
            await engine.stop()
        assert not engine.alive

    history.broken = "bad"
    asyncio.run(main())


def test_full_queue_refuses_with_a_retry_hint():
    async def main():
        engine = AsyncEngine(config(max_waiting=2))
        await engine.start()
        try:
            first = [engine.submit(Turn(f"q{i}", [1, 2, 3], SP)) for i in range(2)]
            with pytest.raises(EngineOverloaded) as refused:
                engine.submit(Turn("q2", [1, 2, 3], SP))
            assert refused.value.retry_after_s > 0
            assert not engine.is_busy("q2")  # nothing was queued for it
            for stream in first:
                assert len([t async for t in stream]) == SP.max_tokens
            r = await engine.generate(Turn("q2", [1, 2, 3], SP))  # room again
            assert len(r.token_ids) == SP.max_tokens
        finally:
            await engine.stop()

    asyncio.run(main())


def test_context_limit_and_typed_snapshot():
    engine = Engine(config())
    assert engine.context_limit == min(engine.max_context, 32 * 32) - 1
    engine.run([Turn("s", [1, 2, 3], SP)])
    snap = engine.snapshot()
    assert snap.context_limit == engine.context_limit
    assert snap.counters.generated_tokens == SP.max_tokens and snap.counters.running == 0
    d = snap.to_dict()
    assert set(d) == {
        "device",
        "model",
        "chunk_size",
        "cache_mode",
        "eviction",
        "pools",
        "counters",
        "sharing",
        "conversations",
        "pins",
        "kv_bytes",
    }
    assert d["pools"]["gpu"] == {"total": 32, "used": 1, "free": 31}
    # one chunk of every layer (one page group: no sliding layers)
    assert d["kv_bytes"]["gpu"] == {"full": engine.pool.bytes_per_chunk, "sliding": 0}
    assert d["sharing"] == {"chunks": 0, "holders": 0, "saved_blocks": 0}
    (conv,) = d["conversations"]
    assert conv["id"] == "s" and conv["tokens"] == 3 + SP.max_tokens
    assert conv["chunks"] == ["gpu"] and conv["running"] is False
    assert conv["holders"] == [1]
    with pytest.raises(ValueError, match="limit|fit"):
        engine.run([Turn("big", [1] * (engine.context_limit + 1), SP)])
    with pytest.raises(AttributeError):
        snap.device = "elsewhere"  # type: ignore[misc]


class LoopKilled(BaseException):
    """Not an Exception: nothing in the loop may swallow it."""


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def kill_loop(engine: AsyncEngine) -> None:
    def crash() -> bool:
        raise LoopKilled("the step loop is gone")

    engine.engine.has_work = crash  # the loop asks this on every turn round


def test_dead_loop_is_not_alive_and_fails_new_turns():
    async def main():
        engine = AsyncEngine(config())
        await engine.start()
        try:
            assert engine.alive
            kill_loop(engine)
            assert await asyncio.to_thread(wait_until, lambda: not engine.alive)
            with pytest.raises(RuntimeError, match="not running"):
                engine.submit(Turn("late", [1, 2], SP))
        finally:
            await engine.stop()

    asyncio.run(main())


def test_healthz_reports_a_dead_engine_loop(tmp_path):
    from starlette.testclient import TestClient

    from app.main import create_app
    from app.settings import Settings

    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path}/pensieve.db",
        model="dummy:tiny",
        device="cpu",
        gpu_cache_chunks=16,
        cpu_cache_chunks=8,
        admin_token="t",
    )
    with TestClient(create_app(settings)) as client:
        ok = client.get("/healthz")
        assert ok.status_code == 200 and ok.json()["checks"]["engine"]["status"] == "ok"
        # the admin page and the metrics read the typed snapshot
        cache = client.get("/api/admin/cache", headers={"Authorization": "Bearer t"}).json()
        assert cache["pools"]["gpu"]["total"] == 16 and cache["conversations"] == []
        metrics = client.get("/metrics").text
        assert 'pensieve:kv_cache_blocks{state="total",tier="gpu"} 16.0' in metrics
        assert 'pensieve:kv_cache_bytes{layers="sliding",tier="gpu"} 0.0' in metrics
        engine = client.app.state.services.engine
        kill_loop(engine)
        assert wait_until(lambda: not engine.alive)
        down = client.get("/healthz")
        assert down.status_code == 503
        assert down.json()["status"] == "down"
        assert down.json()["checks"]["engine"]["status"] == "down"
