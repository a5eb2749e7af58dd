"""The block-copy kernel (kernels/triton_swap.py) and the KV pool's swaps through it.

Under TRITON_INTERPRET=1 on CPU tensors: the kernel's indexing against plain indexing, and
an engine whose swaps all go through the kernel against one that copies run by run. The
`gpu` tests repeat the copies compiled, between GPU memory and a page-locked host tier."""

from __future__ import annotations

import random

import pytest
import torch

import engine.kv_pool as kv_pool
import kernels.triton_swap as triton_swap
from engine import Engine, EngineConfig, SamplingParams, Turn
from engine.copies import CopyPlan
from engine.kv_pool import KVPool
from engine.model.shapes import DUMMY_SHAPES
from tests.engine.test_engine_equality import prompts, ticks
from tests.kernels.test_kernels import INTERPRET, gpu, needs_cuda, needs_triton_cpu


def tier(blocks: int, shape: tuple, dtype: torch.dtype, device="cpu", seed=0) -> torch.Tensor:
    """A [layers, 2, blocks, ...] tier of random values (never zeros: they hide unwritten
    blocks)."""
    g = torch.Generator().manual_seed(seed)
    full = (shape[0], 2, blocks, *shape[1:])
    if dtype.is_floating_point:
        t = torch.randn(full, generator=g).to(dtype)
    else:
        t = torch.randint(1, 120, full, generator=g).to(dtype)
    return t.to(device)


def check_copies(src, dst, rng: random.Random, layers: range, device="cpu") -> None:
    n = rng.randint(1, min(src.shape[2], dst.shape[2]))
    s = rng.sample(range(src.shape[2]), n)
    d = rng.sample(range(dst.shape[2]), n)
    # The expected tier, on the CPU whichever side is the GPU's (a swap-out indexes a CUDA
    # source into a host tier: one device for both)
    want = dst.cpu().clone()
    want[layers.start : layers.stop, :, d] = src.cpu()[layers.start : layers.stop, :, s]
    ids = [torch.tensor(x, dtype=torch.int64, device=device) for x in (s, d)]
    triton_swap.copy_blocks(src, dst, *ids, layers)
    if dst.is_cuda or src.is_cuda:
        torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), want)


@needs_triton_cpu
@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((3, 4, 2, 8), torch.bfloat16),  # a block of K or V: [block_size, kv_heads, head_dim]
        ((3, 4, 2, 8), torch.uint8),  # 8-bit codes
        ((2, 4, 3), torch.float16),  # their scales: [block_size, kv_heads], 24 bytes
        ((2, 3, 1), torch.uint8),  # 3 bytes a block: copied byte by byte
    ],
)
def test_kernel_copies_scattered_blocks(shape, dtype):
    rng = random.Random(str(shape))
    for seed in range(4):
        src, dst = tier(9, shape, dtype, seed=seed), tier(6, shape, dtype, seed=seed + 10)
        layers = range(shape[0]) if seed % 2 else range(1, 2)  # all layers, or one
        check_copies(src, dst, rng, layers)


@needs_triton_cpu
def test_kernel_refuses_what_it_cannot_copy():
    src, dst = tier(4, (2, 4, 8), torch.bfloat16), tier(4, (2, 4, 4), torch.bfloat16)
    ids = torch.tensor([0]), torch.tensor([1])
    with pytest.raises(ValueError, match="blocks differ"):
        triton_swap.copy_blocks(src, dst, *ids, range(2))
    with pytest.raises(ValueError, match="contiguous range"):
        triton_swap.copy_blocks(src, src, *ids, range(0, 2, 2))


@needs_triton_cpu
@pytest.mark.timeout(300)
def test_engine_swaps_through_the_kernel_equal_run_by_run(monkeypatch):
    # Every swap of this engine goes through the kernel (no minimum of runs): the same tokens
    # and the same cache decisions as the engine that copies run by run.
    monkeypatch.setattr(kv_pool, "KERNEL_RUNS", 1)
    launches = []
    copy = triton_swap.copy_blocks
    monkeypatch.setattr(
        triton_swap, "copy_blocks", lambda *a: (launches.append(len(a[2])), copy(*a))[1]
    )
    pools = dict(gpu_cache_chunks=9, cpu_cache_chunks=8, max_batch_tokens=64)
    config = EngineConfig(model="dummy:tiny", device="cpu", **pools)
    engines = [Engine(config, now=ticks()) for _ in "ab"]  # the kernel runs slower here
    kernel, plain = engines
    kernel.pool.copy_kernel = True
    plan = prompts(plain, 4, 3, seed=4, min_len=40, max_len=64)
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    for t in range(3):
        turns = [Turn(f"c{i}", plan[i][t], sp) for i in range(len(plan))]
        for i, (a, b) in enumerate(zip(kernel.run(turns), plain.run(turns), strict=True)):
            assert a.token_ids == b.token_ids, (i, t)
    c = kernel.snapshot().counters
    assert c.swapped_in_tokens > 0 and c.swapped_out_tokens > 0, c
    assert c == plain.snapshot().counters
    assert launches and max(launches) > 1  # scattered blocks went in single launches
    for e in engines:
        e.close()


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((40, 32, 10, 128), torch.bfloat16),
        ((40, 32, 8, 128), torch.uint8),
        ((40, 32, 8), torch.float16),
    ],
)
def test_gpu_kernel_copies_between_gpu_and_page_locked_host(shape, dtype):
    rng = random.Random(str(shape))
    gpu_tier = tier(64, shape, dtype, device="cuda", seed=1)
    host_tier = tier(48, shape, dtype, seed=2).pin_memory()
    for _ in range(3):
        check_copies(gpu_tier, host_tier, rng, range(shape[0]), device="cuda")  # swap-out
        check_copies(host_tier, gpu_tier, rng, range(7, 8), device="cuda")  # a layer of swap-in
    assert kv_pool.kernel_copies_work(torch.device("cuda"))


@gpu
@needs_cuda
def test_gpu_pool_uses_the_kernel():
    e = Engine(
        EngineConfig(model="dummy:tiny", device="cuda", gpu_cache_chunks=9, cpu_cache_chunks=8)
    )
    try:
        assert e.pool.copy_kernel and not INTERPRET
    finally:
        e.close()


@gpu
@needs_cuda
@pytest.mark.parametrize("way_out", ["kernel", "dma"])
@pytest.mark.parametrize("way_in", ["kernel", "dma"])
def test_gpu_pool_swaps_scattered_blocks_each_way(way_out, way_in):
    # Out (this step's and in the background), then back into other blocks, on the copy
    # stream with no host wait: bit for bit, whichever way each direction copies.
    pool = KVPool(DUMMY_SHAPES["tiny"], 32, 32, 32, "cuda", torch.bfloat16)
    pool.kernel = {"out": way_out == "kernel", "in": way_in == "kernel"}
    pool.gpu.normal_()
    original = pool.gpu.clone()
    rng = random.Random(way_out + way_in)
    src, cpu, dst = (
        rng.sample(range(16), 12),
        rng.sample(range(32), 12),
        rng.sample(range(16, 32), 12),
    )
    pool.begin_step(
        CopyPlan(swap_out=list(zip(src[:6], cpu[:6], strict=True))), writes=lambda: set()
    )
    pool.end_step(CopyPlan(background=list(zip(src[6:], cpu[6:], strict=True))))
    # this forward writes blocks both swap-outs read: it must wait for them, on the device
    pool.begin_step(
        CopyPlan(swap_in=list(zip(cpu, dst, strict=True))), writes=lambda: {src[0], src[-1]}
    )
    pool.gpu[:, :, src] = 0  # as that forward would, on the compute stream
    pool.swap_in_now()
    torch.cuda.synchronize()
    assert torch.equal(pool.gpu[:, :, dst], original[:, :, src])
