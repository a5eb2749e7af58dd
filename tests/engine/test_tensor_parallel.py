"""Tensor parallelism on the CPU (gloo, 2 ranks): greedy equality with one rank and with
Hugging Face through swaps, drops, recomputes and suspensions; shapes that do not divide are
refused; a killed worker fails turns with an error instead of a hang."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from engine import AsyncEngine, Engine, EngineConfig, SamplingParams, Turn
from engine.model.loader import BUNDLED, load, own_tensors
from engine.model.shapes import DUMMY_SHAPES
from engine.model.shard import RowParallel, VocabParallel, build_shard, shard_args
from engine.parallel import (
    ParallelPool,
    ParallelRunner,
    Step,
    TensorParallelError,
    _rank_device,
)
from tests.engine.test_engine_equality import prompts, ticks
from tests.engine.test_gpu_engine import bundled_available
from tests.oracle import hf_greedy, hf_model

# 9 chunks hold any one conversation (at most 3 x 64 + 3 x 24 tokens) but not two.
SMALL_POOLS = dict(gpu_cache_chunks=9, cpu_cache_chunks=4, max_batch_tokens=64)


def make(tp: int, now: Callable[[], float] | None = None, **kw) -> Engine:
    config = EngineConfig(model="dummy:tiny", device="cpu", tensor_parallel=tp, **kw)
    return Engine(config, now=now)


def twins(tp: int, force: bool = False, **kw) -> tuple[Engine, Engine]:
    """A tensor-parallel engine and the one-rank engine, whose cache decisions can then only
    differ by what they compute: clocks that move per read, not with how fast each engine's
    steps ran (Cost/T compares idle times), and the same chunk costs (each width profiles
    its own shard)."""
    par = make(tp, now=ticks(), force_tensor_parallel=force, **kw)
    one = make(1, now=ticks(), **kw)
    one.cache.policy.cost = par.cache.policy.cost
    return par, one


_OPEN: list[Engine] = []  # one tensor-parallel engine per process at a time


def close_open() -> None:
    while _OPEN:
        _OPEN.pop().close()


@pytest.fixture(scope="module")
def tp_engine():
    engine = make(2, now=ticks(), **SMALL_POOLS)  # see `twins`
    _OPEN.append(engine)
    yield engine
    close_open()
    engine.close()
    assert not dist.is_initialized()
    for p in engine.backend.tp.procs:
        assert not p.is_alive()


def test_shapes_split_where_they_divide():
    big = DUMMY_SHAPES["llama-2-70b"]  # 64 heads, GQA-8
    for n in (2, 4, 8):
        a = shard_args(big, n)
        assert (a.n_heads, a.n_kv_heads) == (64 // n, 8 // n)
    assert shard_args(DUMMY_SHAPES["llama-2-13b-gqa10"], 2).n_kv_heads == 5
    with pytest.raises(ValueError, match="does not divide the model's 10 KV heads"):
        shard_args(DUMMY_SHAPES["llama-2-13b-gqa10"], 4)


@pytest.mark.parametrize("name,world", [("dummy:tiny", 2), (BUNDLED, 3)])
def test_a_rank_loads_its_share_tensor_by_tensor(name, world):
    # What a rank builds from the checkpoint (or the dummy draws) one tensor at a time is
    # exactly its slice of the whole model: the same weights as before, never all of them.
    cpu = torch.device("cpu")
    full = load(name, cpu, torch.float32).model
    for rank in range(world):
        want = build_shard(full.args, full.state_dict().items(), rank, world, None).state_dict()
        got = build_shard(full.args, own_tensors(name, cpu, torch.float32), rank, world, None)
        got = got.state_dict()
        assert want.keys() == got.keys()
        for key in want:
            assert torch.equal(want[key], got[key]), key
        assert got["lm_head.linear.weight"].shape[0] < full.args.vocab_size


def test_bundled_model_is_refused_at_two_ranks():
    # SmolLM2-135M has 9 heads and 3 KV heads: nothing is started for a shape that cannot split.
    with pytest.raises(
        ValueError, match="tensor_parallel=2 does not divide the model's 9 attention"
    ):
        Engine(EngineConfig(device="cpu", tensor_parallel=2))
    assert not dist.is_initialized()


def test_refusals_before_any_worker():
    with pytest.raises(ValueError, match="tensor_parallel must be a positive integer"):
        make(0)
    assert not dist.is_initialized()


@pytest.mark.timeout(240)
def test_two_ranks_with_8bit_kv_equal_one_rank():
    # Codes and scales are per token per KV head: each rank quantizes its own heads exactly
    # as one rank would, through swaps and recomputes. Runs before the module's engine
    # starts (one tensor-parallel engine per process).
    pools = dict(gpu_cache_chunks=6, cpu_cache_chunks=3, max_batch_tokens=64, kv_dtype="int8")
    two, one = twins(2, **pools)
    try:
        plan = prompts(one, 3, 3, seed=2, min_len=40, max_len=64)
        sp = SamplingParams(max_tokens=16, ignore_eos=True)
        for t in range(3):
            turns = [Turn(f"c{i}", plan[i][t], sp) for i in range(len(plan))]
            for g, w in zip(two.run(turns), one.run(turns), strict=True):
                assert g.token_ids == w.token_ids, t
        c = two.snapshot().counters
        assert c.swapped_in_tokens + c.recomputed_tokens > 0, c
        assert c == one.snapshot().counters
    finally:
        two.close()
        one.close()
    assert not dist.is_initialized()


@pytest.mark.timeout(120)
def test_one_rank_through_the_parallel_path_equals_the_plain_engine():
    # force_tensor_parallel at 1 rank: the code a one-GPU machine runs for TP (a process group
    # of one, the sharded layers with their collectives, a Step per forward, ParallelPool)
    # gives the plain engine's tokens and cache decisions. Runs before the module's engine.
    pools = dict(SMALL_POOLS, max_batch_tokens=48)
    par, one = twins(1, force=True, **pools)
    try:
        assert par.backend.tp is not None and par.backend.tp.world == 1 and not par.backend.tp.procs
        assert dist.get_world_size() == 1
        assert isinstance(par.runner, ParallelRunner) and isinstance(par.pool, ParallelPool)
        assert isinstance(par.model.layers[0].wo, RowParallel)
        assert par.model.layers[0].wo.group is dist.group.WORLD
        assert isinstance(par.model.lm_head, VocabParallel)
        sent: list = []
        send = par.backend.tp.send
        par.backend.tp.send = lambda msg: (sent.append(msg), send(msg))[1]
        plan = prompts(one, 4, 3, seed=3, min_len=40, max_len=64)
        sp = SamplingParams(max_tokens=12, ignore_eos=True)
        for t in range(3):
            turns = [Turn(f"c{i}", plan[i][t], sp) for i in range(len(plan))]
            for i, (g, w) in enumerate(zip(par.run(turns), one.run(turns), strict=True)):
                assert g.token_ids == w.token_ids, (i, t)
        c = par.snapshot().counters
        assert c.swapped_in_tokens > 0 and c.recomputed_tokens > 0, c
        assert c == one.snapshot().counters
        forwards = [m for m in sent if isinstance(m, Step) and m.inputs is not None]
        assert len(forwards) == c.steps  # every step here had a forward
    finally:
        par.close()
        one.close()
    assert not dist.is_initialized()


@pytest.mark.timeout(240)
def test_two_ranks_equal_one_rank_and_hf(tp_engine):
    one = make(1, now=ticks(), **SMALL_POOLS)  # see `twins`
    one.cache.policy.cost = tp_engine.cache.policy.cost
    hf = hf_model(one)
    plan = prompts(one, 4, 3, seed=1, min_len=40, max_len=64)
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    contexts: list[list[int]] = [[] for _ in plan]
    for t in range(3):
        turns = [Turn(f"c{i}", plan[i][t], sp) for i in range(len(plan))]
        got = tp_engine.run(turns)
        want = one.run(turns)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            contexts[i] += plan[i][t]
            assert g.token_ids == w.token_ids, f"conversation {i}, turn {t}: TP=2 != TP=1"
            assert g.token_ids == hf_greedy(hf, contexts[i], 24, set()), (i, t)
            contexts[i] += g.token_ids
        tp_engine.cache.check()
    c = tp_engine.snapshot().counters
    assert c.swapped_in_tokens > 0 and c.recomputed_tokens > 0, c
    assert c.dropped_tokens > 0 and c.suspensions > 0, c
    # The same decisions on both: the plan, not the shard, decides what moves.
    assert c == one.snapshot().counters
    one.close()


@pytest.mark.timeout(120)
async def test_killed_worker_fails_turns_without_a_hang(tp_engine):
    # Runs last: it kills the module's engine.
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    os.kill(tp_engine.backend.tp.procs[0].pid, signal.SIGKILL)
    tp_engine.backend.tp.procs[0].join(10)
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        tp_engine.run([Turn("k0", [1, 2, 3], sp)])
    # Served: the turn ends with the error, and so does the next one.
    server = AsyncEngine(tp_engine.config, engine=tp_engine)
    await server.start()
    try:
        for cid in ("k1", "k2"):
            with pytest.raises(TensorParallelError, match="rank 1"):
                await server.generate(Turn(cid, [4, 5, 6], sp))
    finally:
        await server.stop()


@pytest.mark.timeout(120)
def test_worker_lost_inside_a_collective_fails_fast(tp_engine):
    close_open()
    engine = make(2, gpu_cache_chunks=16)
    try:
        sp = SamplingParams(max_tokens=4, ignore_eos=True)
        assert engine.run([Turn("a", [1, 2, 3], sp)])[0].finish_reason == "length"
        engine.backend.tp.check = lambda: (
            None
        )  # skip the liveness check: the collectives must notice
        os.kill(engine.backend.tp.procs[0].pid, signal.SIGKILL)
        engine.backend.tp.procs[0].join(10)
        t = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            engine.run([Turn("b", [1, 2, 3], sp)])
        assert time.monotonic() - t < 30  # the peer's closed socket, not the collective timeout
    finally:
        engine.close()
    assert not dist.is_initialized()


@pytest.mark.timeout(240)
def test_bundled_model_at_three_ranks_equals_hf():
    # 9 heads, 3 KV heads, intermediate size 1536: 3 ranks divide them all.
    close_open()
    engine = Engine(
        EngineConfig(
            device="cpu",
            tensor_parallel=3,
            gpu_cache_chunks=6,
            cpu_cache_chunks=2,
            max_batch_tokens=64,
        )
    )
    try:
        hf = hf_model(engine)
        plan = prompts(engine, 3, 2, seed=5, min_len=30, max_len=64)
        sp = SamplingParams(max_tokens=8, ignore_eos=True)
        contexts: list[list[int]] = [[] for _ in plan]
        for t in range(2):
            got = engine.run([Turn(f"b{i}", plan[i][t], sp) for i in range(len(plan))])
            for i, g in enumerate(got):
                contexts[i] += plan[i][t]
                assert g.token_ids == hf_greedy(hf, contexts[i], 8, set()), (i, t)
                contexts[i] += g.token_ids
        engine.cache.check()
    finally:
        engine.close()


# ---- CUDA (NCCL): as many ranks as there are GPUs, up to 2 (one GPU: 1 rank, same code) ----

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA_MODELS = [
    ("dummy:tiny", "auto"),
    ("dummy:tiny", "int8"),
    pytest.param(
        BUNDLED,
        "auto",
        marks=pytest.mark.skipif(
            not bundled_available(), reason="the bundled model package is not installed"
        ),
    ),
]


def cuda_ranks(model: str) -> int:
    """The most ranks, up to min(2, GPUs), that split the model (the bundled one: 1)."""
    from engine.model.loader import model_args

    args = model_args(model)
    sizes = (args.n_heads, args.n_kv_heads, args.intermediate_size)
    gpus = min(2, torch.cuda.device_count())
    return max(n for n in range(1, gpus + 1) if all(size % n == 0 for size in sizes))


def cuda_engines(model: str, **kw) -> tuple[Engine, Engine]:
    """A tensor-parallel engine over NCCL (forced at 1 rank) and the plain one-GPU engine
    (eager: CUDA graphs stay off under tensor parallelism), same weights and pools."""
    close_open()  # one tensor-parallel engine per process
    kw = dict(model=model, device="cuda", dtype="float32", **SMALL_POOLS, **kw)
    n = cuda_ranks(model)
    tp = Engine(EngineConfig(**kw, tensor_parallel=n, force_tensor_parallel=True), now=ticks())
    _OPEN.append(tp)
    one = Engine(EngineConfig(**kw, cuda_graphs=False), now=ticks())
    one.cache.policy.cost = tp.cache.policy.cost  # see `twins`
    for engine in (tp, one):
        # On CUDA a swap-in is copied asynchronously, and swap-out ahead waits while one is in
        # flight: how fast the copy ends would decide what moves. Both engines wait for it.
        engine.pool.swap_in_busy = lambda: torch.cuda.synchronize() or False
    return tp, one


def id_prompts(n_convs: int, n_turns: int, seed: int, vocab: int) -> list[list[list[int]]]:
    """Token-id prompts of 40 to 64 tokens (a bare GPU box may have no tokenizer)."""
    rng = random.Random(seed)
    return [
        [[rng.randrange(100, vocab) for _ in range(rng.randint(40, 64))] for _ in range(n_turns)]
        for _ in range(n_convs)
    ]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("model,kv_dtype", CUDA_MODELS)
@pytest.mark.timeout(300)
def test_cuda_ranks_equal_one_gpu_and_hf(model, kv_dtype):
    # float32: the same greedy tokens as the one-GPU engine (and, with a 16-bit KV, as
    # transformers) over 3 turns of 4 conversations, through swaps and recomputes; the same
    # cache decisions.
    tp, one = cuda_engines(model, kv_dtype=kv_dtype)
    try:
        n = tp.backend.tp.world
        assert tp.device == torch.device("cuda", 0) and tp.pool.gpu.device == tp.device
        assert dist.get_backend() == "nccl" and dist.get_world_size() == n
        assert tp.runner.graphs is None and tp.pool.cpu.is_pinned()
        hf = hf_model(one).to("cuda") if kv_dtype == "auto" else None
        plan = id_prompts(4, 3, seed=1, vocab=one.args.vocab_size)
        sp = SamplingParams(max_tokens=24, ignore_eos=True)
        contexts: list[list[int]] = [[] for _ in plan]
        for t in range(3):
            turns = [Turn(f"c{i}", plan[i][t], sp) for i in range(len(plan))]
            got, want = tp.run(turns), one.run(turns)
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                contexts[i] += plan[i][t]
                assert g.token_ids == w.token_ids, f"conversation {i}, turn {t}: TP={n} != 1 GPU"
                if hf is not None:
                    want_hf = hf_greedy(hf, contexts[i], 24, set(), device="cuda")
                    assert g.token_ids == want_hf, (i, t)
                contexts[i] += g.token_ids
            tp.cache.check()
        c = tp.snapshot().counters
        assert c.swapped_in_tokens > 0 and c.recomputed_tokens > 0, c
        assert c == one.snapshot().counters
    finally:
        close_open()
        one.close()
    assert not dist.is_initialized()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.timeout(180)
def test_cuda_killed_worker_fails_turns():
    tp, one = cuda_engines("dummy:tiny")
    one.close()
    try:
        sp = SamplingParams(max_tokens=4, ignore_eos=True)
        assert tp.run([Turn("a", [1, 2, 3], sp)])[0].finish_reason == "length"
        os.kill(tp.backend.tp.procs[0].pid, signal.SIGKILL)
        tp.backend.tp.procs[0].join(10)
        with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            tp.run([Turn("b", [1, 2, 3], sp)])
        assert not dist.is_initialized()  # NCCL aborted at once: nothing left to time out
        with pytest.raises(TensorParallelError, match="rank 1"):
            tp.run([Turn("c", [4, 5, 6], sp)])
    finally:
        close_open()


def test_rank_devices_are_indexed_gpus_after_the_engines():
    # NCCL binds each rank to one GPU by index: "cuda" is cuda:0, rank r the r-th after it.
    assert _rank_device(torch.device("cuda"), 0) == torch.device("cuda", 0)
    assert _rank_device(torch.device("cuda"), 1) == torch.device("cuda", 1)
    assert _rank_device(torch.device("cuda", 2), 1) == torch.device("cuda", 3)
    assert _rank_device(torch.device("cpu"), 1) == torch.device("cpu")
