"""The compiled CPU forward (engine/model/compiled.py): greedy equality with transformers
through swaps, drops and suspensions, one graph for every batch shape, and the fallback."""

from __future__ import annotations

import logging

import torch
from torch._dynamo.utils import counters

from engine import Engine, EngineConfig, SamplingParams, Turn
from engine.model.compiled import _pad
from tests.engine.test_engine_equality import check_against_hf, make
from tests.oracle import hf_model


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_pad_keeps_rows_and_adds_inert_ones():
    assert _pad(torch.tensor([7]), -1).tolist() == [7, -1]
    assert _pad(torch.tensor([], dtype=torch.long), 0).tolist() == [0, 0]
    t = torch.tensor([1, 2, 3])
    out = _pad(t, 0)
    assert out.tolist() == [1, 2, 3] and out.data_ptr() != t.data_ptr()  # a copy


def test_compiled_engine_matches_transformers_and_compiles_once():
    """Mixed prefill and decode steps of every size, single-row steps, swaps, recomputes of
    dropped chunks and suspensions: the same tokens as transformers, from the one graph
    compiled at start. The bundled model only: dummy:tiny's compiled path is checked against
    eager below, and a second model here cost 36 s of compiling for the same checks."""
    before = graphs()
    engine = make(
        "smollm2-135m-instruct",
        compile_cpu=True,
        gpu_cache_chunks=9,
        cpu_cache_chunks=4,
        max_batch_tokens=64,
    )
    assert engine.runner.compiled is not None
    assert graphs() == before + 1
    hf = hf_model(engine)
    got = check_against_hf(
        engine, hf, max_tokens=24, seed=1, min_len=40, max_len=64, ignore_eos=True
    )
    for key in ("swapped_in_tokens", "recomputed_tokens", "cached_tokens", "suspensions"):
        assert got[key] > 0, got
    check_against_hf(engine, hf, n_convs=1, n_turns=2, max_tokens=5, seed=2, max_len=5)
    assert graphs() == before + 1, "a batch shape recompiled the forward"


def test_compiled_equals_eager_on_shared_prefixes_and_single_tokens():
    """Prefix sharing (pool blocks linked across conversations) and one-token prompts."""
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    system = list(range(40, 110))
    runs = []
    for compile_cpu in (False, True):
        engine = make("dummy:tiny", compile_cpu=compile_cpu, gpu_cache_chunks=64)
        out = engine.run([Turn(f"c{i}", system + [200 + i] * (i + 1), sp) for i in range(5)])
        out += engine.run([Turn("one", [9], sp)])
        runs.append([r.token_ids for r in out])
        assert engine.snapshot().sharing.chunks > 0  # pool blocks linked across chats
    assert runs[0] == runs[1]


def test_an_8bit_pool_runs_eagerly_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="engine.engine"):
        engine = Engine(
            EngineConfig(
                model="dummy:tiny", device="cpu", gpu_cache_chunks=16, kv_dtype="int8",
                compile_cpu=True,
            )
        )  # fmt: skip
    assert engine.runner.compiled is None
    assert "compile_cpu" in caplog.text
    (r,) = engine.run([Turn("a", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))])
    assert len(r.token_ids) == 4


def test_a_forward_that_does_not_compile_runs_eagerly(caplog):
    """No usable C++ compiler (here: a compiler that does not exist) means eager steps."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()  # nothing compiled earlier in this process is reused
    with (
        inductor_config.patch({"cpp.cxx": ("no-such-c++",), "fx_graph_cache": False}),
        caplog.at_level(logging.WARNING, logger="engine.engine"),
    ):
        engine = make("dummy:tiny", compile_cpu=True, gpu_cache_chunks=16)
    assert engine.runner.compiled is None
    assert "did not compile" in caplog.text
    (r,) = engine.run([Turn("a", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))])
    assert len(r.token_ids) == 4
