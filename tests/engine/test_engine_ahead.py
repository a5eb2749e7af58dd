"""The host a step ahead (`EngineConfig.async_steps`): step N is planned and launched before
step N-1's tokens are read, with placeholders for them. The equality tests run the lagged loop
through swaps, drops, recomputes and suspensions (tests/engine/test_engine_equality.py); these
check its edges: a turn that ends while its next piece is in flight, cancels, guided turns,
the last token of a turn, seeded sampling and the async front."""

from __future__ import annotations

import asyncio

import pytest

from engine import AsyncEngine, Engine, EngineConfig, Guide, SamplingParams, Turn
from engine.request import Request, Status
from tests.oracle import hf_greedy, hf_model

PROMPT = list(range(10, 40))


def make(ahead: bool, model: str = "dummy:tiny", **kw) -> Engine:
    kw = {"gpu_cache_chunks": 32, "cpu_cache_chunks": 16} | kw
    engine = Engine(EngineConfig(model=model, device="cpu", async_steps=ahead, **kw))
    assert engine.steps.ahead == ahead
    return engine


@pytest.fixture(scope="module")
def hf():
    return hf_model(make(False))


def launched(engine: Engine) -> list[list[tuple[Request, int, int, bool]]]:
    """Record the pieces of every step the engine launches: (turn, start, end, sample)."""
    steps: list[list[tuple[Request, int, int, bool]]] = []
    launch = engine.runner.launch

    def spy(pieces, plan, sampled=None):
        steps.append([(p.req, p.start, p.end, p.sample) for p in pieces])
        return launch(pieces, plan, sampled)

    engine.runner.launch = spy
    return steps


def test_default_is_on_for_cuda_only():
    assert not Engine(
        EngineConfig(model="dummy:tiny", device="cpu", gpu_cache_chunks=8)
    ).steps.ahead
    sim = Engine(EngineConfig(model="dummy:tiny", device="sim:h100", async_steps=True))
    assert not sim.steps.ahead  # a simulated device stays in step


def test_stop_token_while_the_next_piece_is_in_flight(hf):
    """A turn ends on a stop token whose next position was launched already: that step's token
    is dropped, the stream keeps the stop token as its tail, and the next turn goes on from
    it as with steps in order."""
    free = make(False).run([Turn("s", PROMPT, SamplingParams(max_tokens=8))])[0].token_ids
    k = next(i for i in range(2, 8) if free[i] not in free[:i])
    sp = SamplingParams(max_tokens=8, stop_token_ids=(free[k],))
    engines = {ahead: make(ahead) for ahead in (False, True)}
    steps = launched(engines[True])
    out = {}
    for ahead, engine in engines.items():
        first = engine.run([Turn("s", PROMPT, sp)])[0]
        assert first.finish_reason == "stop" and first.token_ids == free[: k + 1]
        state = engine.streams["s"]
        assert state.tail == [free[k]] and state.kv_len == state.length - 1
        second = engine.run([Turn("s", [5, 6, 7], SamplingParams(max_tokens=6))])[0]
        engine.cache.check()
        out[ahead] = second.token_ids
    stop_at = len(PROMPT) + k  # the stop token's position: launched before it was known
    assert any(p[1] == stop_at and p[3] for step in steps for p in step)
    assert out[True] == out[False] == hf_greedy(hf, PROMPT + free[: k + 1] + [5, 6, 7], 6, set())


def test_cancel_with_a_token_in_flight(hf):
    engine = make(True)
    req = engine.submit(Turn("c", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True)))
    for _ in range(4):
        engine.step()
    assert engine.in_flight and req.ahead and req.tokens[-1] < 0
    engine.cancel(req)
    assert req in engine.step()
    result = req.result()
    assert result.finish_reason == "cancelled"
    want = hf_greedy(hf, PROMPT, 50, set())
    assert result.token_ids == want[: len(result.token_ids)] and len(result.token_ids) >= 3
    state = engine.streams["c"]
    assert state.length == len(PROMPT) + len(result.token_ids)
    assert all(t >= 0 for t in req.tokens) and all(t >= 0 for t in state.tail)
    engine.flush()
    engine.cache.check()
    context = PROMPT + result.token_ids + [3, 4]
    again = engine.run([Turn("c", [3, 4], SamplingParams(max_tokens=5, ignore_eos=True))])[0]
    assert again.token_ids == hf_greedy(hf, context, 5, set())


def test_fail_all_with_a_step_in_flight(hf):
    """A failed step fails every turn; the step in flight is forgotten and no placeholder is
    left in a stream, so the conversations go on from what their turns kept."""
    engine = make(True)
    reqs = [engine.submit(Turn(f"f{i}", PROMPT[i:], SamplingParams(max_tokens=30))) for i in (0, 5)]
    for _ in range(3):
        engine.step()
    assert engine.in_flight and all(r.ahead for r in reqs)
    assert set(engine.fail_all(RuntimeError("boom"))) == set(reqs)
    assert not engine.in_flight and not engine.has_work()
    for i, req in zip((0, 5), reqs, strict=True):
        result = req.result()
        assert result.finish_reason == "error" and len(result.token_ids) == 2
        state = engine.streams[req.state.id]
        assert all(t >= 0 for t in state.tail)
        assert state.length == len(PROMPT[i:]) + 2
        context = PROMPT[i:] + result.token_ids + [8]
        again = engine.run([Turn(req.state.id, [8], SamplingParams(max_tokens=4, ignore_eos=True))])
        assert again[0].token_ids == hf_greedy(hf, context, 4, set())
    engine.cache.check()


def test_max_tokens_ends_without_a_wasted_step():
    engine = make(True)
    steps = launched(engine)
    turns = [
        Turn(f"m{n}", PROMPT[:n], SamplingParams(max_tokens=n, ignore_eos=True)) for n in (1, 4, 9)
    ]
    results = engine.run(turns)
    assert [len(r.token_ids) for r in results] == [1, 4, 9]
    for r in results:  # one sampling piece a token, none after the last
        sampled = [p for step in steps for p in step if p[0].state.id == r.conversation_id and p[3]]
        assert len(sampled) == len(r.token_ids)
    assert not engine.in_flight and not engine.has_work()


def test_seeded_sampling_draws_the_same_tokens():
    turns = [
        Turn("a", PROMPT, SamplingParams(max_tokens=12, temperature=0.9, seed=3)),
        Turn("b", PROMPT[:7], SamplingParams(max_tokens=9, temperature=1.2, top_k=20, seed=4)),
        Turn("c", PROMPT[3:], SamplingParams(max_tokens=10, temperature=0.7, top_p=0.8, seed=5)),
        Turn("d", PROMPT[5:], SamplingParams(max_tokens=11)),
    ]
    want = [r.token_ids for r in make(False).run(turns)]
    assert [r.token_ids for r in make(True).run(turns)] == want


def test_suspended_turns_accept_their_tokens_in_flight():
    """A pool too small for every turn: turns are suspended with a token in flight, which
    they keep (or end by), and resume as with steps in order."""
    turns = [
        Turn(f"s{i}", PROMPT + [i], SamplingParams(max_tokens=40, ignore_eos=True))
        for i in range(4)
    ]
    kw = {"gpu_cache_chunks": 10, "cpu_cache_chunks": 32}
    ahead = make(True, **kw)
    got = ahead.run(turns)
    assert [r.token_ids for r in got] == [r.token_ids for r in make(False, **kw).run(turns)]
    assert ahead.snapshot().counters.suspensions > 0
    ahead.cache.check()


def test_guided_turns_go_step_by_step_beside_lagged_ones(monkeypatch):
    pytest.importorskip("llguidance")
    tok = make(False, "smollm2-135m-instruct", gpu_cache_chunks=64).tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Describe a cat as JSON."}],
        add_generation_prompt=True, tokenize=True, return_dict=False,
    )  # fmt: skip
    turns = [
        Turn("g", prompt, SamplingParams(max_tokens=24, guide=Guide("json_object"))),
        Turn("f", prompt, SamplingParams(max_tokens=16)),
        Turn("m", prompt, SamplingParams(max_tokens=20, min_tokens=12)),
    ]
    ran_ahead: list[str] = []
    run_ahead = Request.run_ahead
    monkeypatch.setattr(
        Request, "run_ahead", lambda r, row: ran_ahead.append(r.state.id) or run_ahead(r, row)
    )
    got = make(True, "smollm2-135m-instruct", gpu_cache_chunks=64).run(turns)
    assert "g" not in ran_ahead and "f" in ran_ahead
    assert "m" in ran_ahead  # past its min_tokens
    want = make(False, "smollm2-135m-instruct", gpu_cache_chunks=64).run(turns)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_async_front_streams_cancels_and_flushes():
    async def main():
        engine = make(True)
        front = AsyncEngine(engine=engine)
        await front.start()
        try:
            stream = front.submit(Turn("as", PROMPT, SamplingParams(max_tokens=8)))
            tokens = [t async for t in stream]
            assert tokens == stream.result.token_ids and len(tokens) == 8
            stream = front.submit(Turn("as", [4], SamplingParams(max_tokens=500, ignore_eos=True)))
            n = 0
            async for _ in stream:
                n += 1
                if n == 2:
                    stream.cancel()
            assert stream.result.finish_reason == "cancelled" and len(stream.result.token_ids) < 500
            r = await front.generate(Turn("as", [6], SamplingParams(max_tokens=3)))
            assert len(r.token_ids) == 3
            for _ in range(100):  # the loop reads the last step in flight, then idles
                if not engine.in_flight:
                    break
                await asyncio.sleep(0.01)
            assert not engine.has_work() and all(
                r.status == Status.FINISHED for r in engine.scheduler.turns()
            )
        finally:
            await front.stop()

    asyncio.run(main())
