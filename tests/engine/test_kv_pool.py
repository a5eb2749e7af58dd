"""KV pool copies: what goes out to the CPU tier comes back bit for bit."""

from __future__ import annotations

import torch

from engine.copies import CopyPlan
from engine.kv_pool import KERNEL_RUNS, KVPool, runs
from engine.model.shapes import DUMMY_SHAPES


def test_runs_coalesce_consecutive_pairs():
    assert runs([(5, 1), (3, 9), (4, 10), (6, 2), (8, 3)]) == [(3, 9, 2), (5, 1, 2), (8, 3, 1)]
    assert runs([]) == []
    # block 1 was written twice in one plan: the later copy wins, whatever the order of runs
    assert runs([(4, 1), (1, 1), (0, 1)]) == [(0, 1, 1)]
    assert runs([(0, 1), (5, 1), (6, 2)]) == [(5, 1, 2)]


def test_swap_out_then_in_restores_blocks():
    args = DUMMY_SHAPES["tiny"]
    pool = KVPool(args, gpu_blocks=8, cpu_blocks=8, block_size=4, device="cpu", dtype=torch.float32)
    pool.gpu.normal_()
    original = pool.gpu.clone()
    pool.begin_step(CopyPlan(swap_out=[(1, 6), (2, 7), (5, 0)]))
    pool.gpu[:, :, [1, 2, 5]] = 0.0
    # swap back into other GPU blocks, layer by layer as the forward asks for them
    pool.begin_step(CopyPlan(swap_in=[(6, 3), (7, 4), (0, 0)]))
    for layer in range(args.n_layers):
        pool.before_attention(layer)
    pool.end_step(CopyPlan())
    assert torch.equal(pool.gpu[:, :, 3], original[:, :, 1])
    assert torch.equal(pool.gpu[:, :, 4], original[:, :, 2])
    assert torch.equal(pool.gpu[:, :, 0], original[:, :, 5])


def test_many_scattered_blocks_move_in_one_gather_on_the_cpu():
    """From KERNEL_RUNS runs up the CPU copies every block of a layer at once: same bytes."""
    args = DUMMY_SHAPES["tiny"]
    pool = KVPool(
        args, gpu_blocks=16, cpu_blocks=16, block_size=4, device="cpu", dtype=torch.float32
    )
    assert not pool.copy_kernel
    pool.gpu.normal_()
    original = pool.gpu.clone()
    out = [(0, 9), (2, 3), (4, 7), (6, 1), (8, 12), (9, 13)]  # 5 runs: (8, 12) and (9, 13) join
    assert len(runs(out)) >= KERNEL_RUNS
    pool.begin_step(CopyPlan(swap_out=out))
    assert all(torch.equal(pool.cpu[:, :, c], original[:, :, g]) for g, c in out)
    pool.gpu.zero_()
    back = [(c, 15 - g) for g, c in out]
    pool.begin_step(CopyPlan(swap_in=back))
    for layer in range(args.n_layers):
        assert torch.equal(pool.gpu[layer, :, 15], torch.zeros_like(pool.gpu[layer, :, 15]))
        pool.before_attention(layer)
    pool.end_step(CopyPlan())
    assert all(torch.equal(pool.gpu[:, :, 15 - g], original[:, :, g]) for g, _ in out)
    assert not pool.gpu[:, :, [b for b in range(16) if b not in {15 - g for g, _ in out}]].any()


def test_background_copy_after_forward():
    args = DUMMY_SHAPES["tiny"]
    pool = KVPool(args, gpu_blocks=4, cpu_blocks=4, block_size=4, device="cpu", dtype=torch.float32)
    pool.gpu.normal_()
    pool.end_step(CopyPlan(background=[(2, 3)]))
    assert torch.equal(pool.cpu[:, :, 3], pool.gpu[:, :, 2])


def test_a_host_pool_that_cannot_be_pinned_is_halved(monkeypatch) -> None:
    """The CPU tier asks to page-lock its memory; the host may refuse far below its free RAM."""
    from engine import kv_pool

    pinned: list[int] = []

    def pin(t: torch.Tensor) -> None:
        if t.nbytes > 10_000:
            raise RuntimeError("cudaHostRegister refused")
        pinned.append(t.nbytes)

    monkeypatch.setattr(kv_pool, "_pin", pin)
    monkeypatch.setattr(kv_pool, "_unpin", lambda t: None)
    pool = kv_pool.KVPool.__new__(kv_pool.KVPool)  # the host side only: no GPU here
    pool.cuda = True
    (host,) = pool._host_pool(2, 40, [((4, 1, 8), torch.float32)])  # 256 bytes a block and layer
    assert host.shape == (2, 2, 10, 4, 1, 8)  # 40 -> 20 -> 10 blocks
    assert pinned == [host.nbytes] and host.abs().sum() == 0
    # An 8-bit tier: codes and scales are pinned, or halved, together.
    pinned.clear()
    codes, scales = pool._host_pool(2, 80, [((4, 1, 8), torch.uint8), ((4, 1), torch.float16)])
    assert codes.shape[2] == scales.shape[2] == 40  # 80 blocks of codes: 10,240 bytes
    assert pinned == [codes.nbytes, scales.nbytes]
    pool.cuda = False
    (host,) = pool._host_pool(2, 40, [((4, 1, 8), torch.float32)])
    assert host.shape[2] == 40  # CPU: never pinned
