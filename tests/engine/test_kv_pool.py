"""KV pool copies: what goes out to the CPU tier comes back bit for bit."""

from __future__ import annotations

import pytest
import torch

from engine.copies import CopyPlan, PendingReads, StagingRing, written_blocks
from engine.kv_pool import KERNEL_RUNS, KVPool, runs, swap_copies
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


class FakeFence:
    """An event the test finishes by hand."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


def test_the_forward_waits_only_for_swap_outs_of_blocks_it_writes():
    reads = PendingReads()
    background, now = FakeFence(), FakeFence()
    reads.add(background, [3, 4])  # the last step's ahead-of-time copies
    reads.add(now, [7])  # this step's swap-out: block 7 freed, maybe handed out again
    reads.add(FakeFence(), [])  # nothing read: nothing to wait for
    assert len(reads.batches) == 2
    assert reads.blocking({1, 2}) == []  # blocks nobody reads: the forward never waits
    assert reads.blocking({2, 7}) == [now]
    assert reads.blocking({4, 7}) == [background, now]
    assert reads.blocking(None) == [background, now]  # not known: wait for all
    background.done = True
    reads.retire()
    assert reads.blocking({3, 4, 7}) == [now] and not background.waited  # queried, not waited


def test_written_blocks_are_those_of_the_positions_computed():
    tables = [[10, 11, 12], [20, 21], [30]]
    # a decode at position 70 (block 2), a prefill of [16, 40) (blocks 0 and 1), a recompute
    assert written_blocks(tables, [70, 16, 0], [71, 40, 32], 32) == {12, 20, 21, 30}
    assert written_blocks([], [], [], 32) == set()


def test_staging_slots_are_rewritten_only_after_their_upload():
    ring = StagingRing.of(2)
    a, grow = ring.take(10)
    assert grow == 64  # grown to a minimum, then doubled
    a.capacity, a.fence = grow, FakeFence()
    b, grow = ring.take(100)
    assert b is not a and grow == 100
    b.capacity, b.fence = grow, FakeFence()
    b.fence.done = True
    again, grow = ring.take(64)  # round: a's upload still runs, the host waits for it
    assert again is a and grow is None and a.fence is None and ring.waits == 1
    fence = b.fence
    again, grow = ring.take(300)  # b's upload ran: no wait; it grows to twice or what is asked
    assert again is b and grow == 300 and ring.waits == 1 and not fence.waited


def test_swap_copies_per_direction():
    assert swap_copies(None) == {"out": "kernel", "in": "kernel"}
    assert swap_copies("dma") == {"out": "dma", "in": "dma"}
    assert swap_copies("out=dma, in=kernel") == {"out": "dma", "in": "kernel"}
    assert swap_copies("in=dma") == {"out": "kernel", "in": "dma"}
    for bad in ("gpu", "up=dma", "out=fast"):
        with pytest.raises(ValueError, match="PENSIEVE_SWAP_COPY"):
            swap_copies(bad)


def test_kernel_ids_come_from_the_staging_ring_and_the_kernel_skips_few_long_runs():
    args = DUMMY_SHAPES["tiny"]
    pool = KVPool(
        args, gpu_blocks=40, cpu_blocks=40, block_size=4, device="cpu", dtype=torch.float32
    )
    pool.kernel = {"out": True, "in": False}
    scattered = pool._moves([(1, 6), (3, 9), (5, 0)], "out")
    assert scattered.ids is not None
    assert [x.tolist() for x in scattered.ids] == [[1, 3, 5], [6, 9, 0]]
    assert pool._moves([(1, 6)], "out").ids is not None  # one short run: one launch, not 2L
    long = [(i, 20 + i) for i in range(16)] + [(30, 0)]  # 2 runs of 8.5 blocks on average
    assert pool._moves(long, "out").ids is None
    assert pool._moves([(1, 6), (3, 9)], "in").ids is None  # the copy engine, as chosen
    assert pool.copy_kernel
    pool.copy_kernel = False
    assert pool.kernel == {"out": False, "in": False}
