"""Engine API behaviour: validation, sampling, batch invariance, the async front."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine import (
    AsyncEngine,
    ConversationBusy,
    Engine,
    EngineConfig,
    SamplingParams,
    Turn,
    async_engine,
)


@pytest.fixture(scope="module")
def tiny() -> Engine:
    return Engine(
        EngineConfig(model="dummy:tiny", device="cpu", gpu_cache_chunks=64, cpu_cache_chunks=16)
    )


@pytest.fixture(scope="module")
def smol() -> Engine:
    return Engine(EngineConfig(model="smollm2-135m-instruct", device="cpu", gpu_cache_chunks=64))


def chat(engine: Engine, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    return engine.tokenizer.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=False
    )


@pytest.mark.parametrize(
    "turn, message",
    [
        (Turn("x", []), "empty"),
        (Turn("", [1, 2]), "conversation_id"),
        (Turn("x", [1, -5]), "token ids"),
        (Turn("x", [1, 10**9]), "token ids"),
        (Turn("x", [1], SamplingParams(max_tokens=0)), "max_tokens"),
        (Turn("x", [1], SamplingParams(temperature=-1.0)), "temperature"),
        (Turn("x", [1], SamplingParams(top_p=0.0)), "top_p"),
        (Turn("x", [1], SamplingParams(top_k=-2)), "top_k"),
        (Turn("x", [1], SamplingParams(seed="abc")), "seed"),  # type: ignore[arg-type]
        (Turn("x", [1], context_len=-1), "context_len"),
    ],
)
def test_invalid_turns_raise_clear_errors(tiny, turn, message):
    with pytest.raises(ValueError, match=message):
        tiny.run([turn])
    assert "x" not in tiny.streams  # nothing was left half-submitted


def test_prompt_longer_than_context(tiny):
    with pytest.raises(ValueError, match="limit"):
        tiny.run([Turn("long", [1] * (tiny.max_context + 1))])


def test_prompt_larger_than_cache():
    engine = Engine(
        EngineConfig(model="dummy:tiny", device="cpu", gpu_cache_chunks=2, cpu_cache_chunks=0)
    )
    with pytest.raises(ValueError, match="does not fit"):
        engine.run([Turn("big", [1] * 100)])


def test_unknown_model_and_bad_config():
    with pytest.raises(ValueError, match="unknown model"):
        Engine(EngineConfig(model="no-such-model", device="cpu"))
    with pytest.raises(ValueError, match="unknown dummy shape"):
        Engine(EngineConfig(model="dummy:nope", device="cpu"))
    with pytest.raises(ValueError, match="cache_mode"):
        Engine(EngineConfig(model="dummy:tiny", cache_mode="sometimes"))
    with pytest.raises(ValueError, match="eviction"):
        Engine(EngineConfig(model="dummy:tiny", eviction="random"))


def test_conversation_busy(tiny):
    tiny.submit(Turn("busy", [1, 2, 3], SamplingParams(max_tokens=2)))
    with pytest.raises(ConversationBusy):
        tiny.submit(Turn("busy", [4], SamplingParams(max_tokens=2)))
    while tiny.has_work():
        tiny.step()


def test_batch_invariance(smol):
    """A conversation's greedy output does not depend on what else is in the batch."""
    sp = SamplingParams(max_tokens=24)
    target = chat(smol, "What is the capital of France?")
    alone = smol.run([Turn("alone", target, sp)])[0].token_ids
    others = [
        Turn(f"o{i}", chat(smol, "Tell me a story about dragons " * (i + 1)), sp) for i in range(5)
    ]
    crowded = smol.run([*others[:3], Turn("crowded", target, sp), *others[3:]])
    assert crowded[3].token_ids == alone
    # and with a token budget that splits the others' prompts across steps
    split = Engine(
        EngineConfig(
            model="smollm2-135m-instruct", device="cpu", gpu_cache_chunks=64, max_batch_tokens=16
        )
    )
    again = split.run([*others[:2], Turn("split", target, sp)])
    assert again[2].token_ids == alone


def test_sampling_is_reproducible_with_a_seed(tiny):
    sp = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    a = tiny.run([Turn("s1", [5, 6, 7], sp)])[0].token_ids
    b = tiny.run([Turn("s2", [5, 6, 7], sp)])[0].token_ids
    c = tiny.run([Turn("s3", [5, 6, 7], SamplingParams(max_tokens=16, temperature=0.9, seed=99))])[
        0
    ].token_ids
    assert a == b
    assert a != c
    greedy = tiny.run([Turn("s4", [5, 6, 7], SamplingParams(max_tokens=16))])[0].token_ids
    assert a != greedy


def test_top_k_one_is_greedy(tiny):
    hot = SamplingParams(max_tokens=12, temperature=5.0, top_k=1, seed=7)
    assert (
        tiny.run([Turn("k1", [9, 8, 7], hot)])[0].token_ids
        == tiny.run([Turn("k2", [9, 8, 7], SamplingParams(max_tokens=12))])[0].token_ids
    )


def test_stop_token_ends_turn_and_is_included(smol):
    r = smol.run([Turn("stop", chat(smol, "Say hi."), SamplingParams(max_tokens=200))])[0]
    assert r.finish_reason == "stop" and type(r.finish_reason) is str  # the value, not the enum
    assert r.token_ids[-1] in smol.stop_token_ids
    r = smol.run(
        [Turn("eos", chat(smol, "Say hi."), SamplingParams(max_tokens=30, ignore_eos=True))]
    )[0]
    assert r.finish_reason == "length" and len(r.token_ids) == 30


def test_context_len_resync_recomputes_from_history(tiny):
    """A server restarted: the engine learns the context from context_len and the history."""
    from engine import MemoryHistory

    history = MemoryHistory()
    first = Engine(
        EngineConfig(model="dummy:tiny", device="cpu", gpu_cache_chunks=32), history=None
    )
    prompt1, prompt2 = list(range(10, 60)), [3, 4, 5]
    out1 = first.run([Turn("r", prompt1, SamplingParams(max_tokens=10))])[0].token_ids
    expected = first.run([Turn("r", prompt2, SamplingParams(max_tokens=10))])[0].token_ids
    history.append("r", prompt1 + out1 + prompt2)
    fresh = Engine(
        EngineConfig(model="dummy:tiny", device="cpu", gpu_cache_chunks=32), history=history
    )
    got = fresh.run(
        [Turn("r", prompt2, SamplingParams(max_tokens=10), context_len=len(prompt1 + out1))]
    )[0]
    assert got.token_ids == expected
    assert got.stats.recomputed_tokens == len(prompt1 + out1)


def test_async_streams_and_cancels(tiny):
    async def main():
        engine = AsyncEngine(engine=tiny)
        await engine.start()
        try:
            stream = engine.submit(Turn("as", [1, 2, 3], SamplingParams(max_tokens=8)))
            tokens = [t async for t in stream]
            assert tokens == stream.result.token_ids and len(tokens) == 8
            stream = engine.submit(Turn("as", [4], SamplingParams(max_tokens=500, ignore_eos=True)))
            with pytest.raises(ConversationBusy):
                engine.submit(Turn("as", [5]))
            n = 0
            async for _ in stream:
                n += 1
                if n == 2:
                    stream.cancel()
            assert stream.result.finish_reason == "cancelled"
            assert len(stream.result.token_ids) < 500
            # the conversation goes on after a cancel
            r = await engine.generate(Turn("as", [6], SamplingParams(max_tokens=3)))
            assert len(r.token_ids) == 3
            await engine.free("as")
            assert all(c.id != "as" for c in tiny.snapshot().conversations)
        finally:
            await engine.stop()

    asyncio.run(main())


class CountingFront(AsyncEngine):
    """Records each hand-over from the loop thread: (tokens by conversation, ends)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine=engine)
        self.handed: list[tuple[list[str], int]] = []

    def _deliver(self, tokens, ends) -> None:
        self.handed.append(([s.turn.conversation_id for s, _ in tokens], len(ends)))
        super()._deliver(tokens, ends)


def test_async_hands_a_steps_tokens_over_at_once(tiny):
    """One call to the event loop per step, carrying every turn's token of it, then the ends."""

    async def main():
        front = CountingFront(tiny)
        await front.start()
        try:
            sp = SamplingParams(max_tokens=6, ignore_eos=True)
            steps = tiny.counters.steps
            streams = [front.submit(Turn(f"hand{i}", [1, 2, 3], sp)) for i in range(4)]
            got = {s.turn.conversation_id: [t async for t in s] for s in streams}
            steps = tiny.counters.steps - steps
        finally:
            await front.stop()
        for s in streams:
            assert (
                got[s.turn.conversation_id] == s.result.token_ids and len(s.result.token_ids) == 6
            )
        assert sum(len(ids) for ids, _ in front.handed) == 24
        assert sum(ends for _, ends in front.handed) == 4
        assert len(front.handed) <= steps < 24  # a hand-over per step, never per token
        assert all(len(ids) == len(set(ids)) for ids, _ in front.handed)  # a token each a step
        assert max(len(ids) for ids, _ in front.handed) == 4  # the turns decode side by side

    asyncio.run(main())


class WhereBuilt(Engine):
    """An engine that records the thread it was built on."""

    def __init__(self, *args) -> None:
        self.built_on = threading.current_thread()
        super().__init__(*args)


def test_async_builds_its_engine_on_the_thread_that_steps_it(monkeypatch):
    """One thread holds the model's OpenMP team: the loop thread builds the engine it steps."""
    monkeypatch.setattr(async_engine, "Engine", WhereBuilt)

    async def main():
        front = AsyncEngine(EngineConfig(model="dummy:tiny", device="cpu", gpu_cache_chunks=16))
        await front.start()
        try:
            assert front.engine.built_on is front._thread
            r = await front.generate(Turn("t", [1, 2, 3], SamplingParams(max_tokens=4)))
            assert len(r.token_ids) == 4
        finally:
            await front.stop()

    asyncio.run(main())


def test_async_start_raises_what_the_build_raised():
    async def main():
        front = AsyncEngine(EngineConfig(model="no-such-model", device="cpu"))
        with pytest.raises(ValueError, match="unknown model"):
            await front.start()
        assert not front.alive

    asyncio.run(main())


def test_built_apart_leaves_no_thread_behind(monkeypatch):
    monkeypatch.setattr(async_engine, "Engine", WhereBuilt)
    before = set(threading.enumerate())
    engine = async_engine.built_apart(
        EngineConfig(model="dummy:tiny", device="cpu", gpu_cache_chunks=16, cpu_cache_chunks=0)
    )
    assert engine.built_on is not threading.current_thread()
    assert not engine.built_on.is_alive()
    assert set(threading.enumerate()) <= before
    engine.close()


def test_hugging_face_model_dir_loads_like_the_original(tiny, tmp_path):
    """A safetensors model dir (here: the tiny dummy saved by transformers) gives the same tokens."""
    import shutil

    from engine.model.loader import convert_bundled
    from tests.oracle import hf_model

    hf_model(tiny).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(convert_bundled(None) / name, tmp_path / name)
    from_dir = Engine(EngineConfig(model=str(tmp_path), device="cpu", gpu_cache_chunks=16))
    sp = SamplingParams(max_tokens=12)
    assert (
        from_dir.run([Turn("d", [11, 12, 13], sp)])[0].token_ids
        == tiny.run([Turn("d0", [11, 12, 13], sp)])[0].token_ids
    )


def test_turn_that_fills_the_whole_cache_ends_with_length():
    engine = Engine(
        EngineConfig(model="dummy:tiny", device="cpu", gpu_cache_chunks=3, cpu_cache_chunks=0)
    )
    r = engine.run([Turn("fill", [1] * 60, SamplingParams(max_tokens=100, ignore_eos=True))])[0]
    assert r.finish_reason == "length"
    assert 60 + len(r.token_ids) == 3 * 32 + 1  # the last sampled token needs no KV slot
    engine.cache.check()


def test_large_dummy_shapes_are_built_in_their_dtype():
    """The on-device dummy builder (used for the GPU presets) never holds a float32 copy."""
    import torch

    from engine.model.loader import _dummy_on_device
    from engine.model.shapes import DUMMY_SHAPES

    model = _dummy_on_device(DUMMY_SHAPES["tiny"], 0, torch.device("cpu"), torch.bfloat16)
    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.bfloat16}
    assert all(torch.isfinite(p.float()).all() for p in params.values())
    assert torch.equal(params["norm.weight"], torch.ones_like(params["norm.weight"]))
    std = params["layers.0.w13.weight"].float().std().item()  # N(0, 1 / fan_in)
    assert abs(std - DUMMY_SHAPES["tiny"].dim ** -0.5) < 0.1 * std
    again = _dummy_on_device(DUMMY_SHAPES["tiny"], 0, torch.device("cpu"), torch.bfloat16)
    assert torch.equal(again.embed.weight, model.embed.weight)  # seeded
