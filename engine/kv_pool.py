"""The KV tensors of both tiers and the copies between them.

Both tiers are laid out [slots, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]; the
CPU tier is page-locked. A block is a page of `engine/kv_layout.py`: `slots` layers of
`block_size` positions, each layer reading its slot through its group's block table (without
a window: every layer, one group, slots = layers). A copy plan is coalesced into runs of consecutive blocks on both sides,
so a run moves as one contiguous transfer per layer and K/V (the pools hand out low block
ids first, so a conversation's chunks tend to form long runs). On the CPU the same calls
copy synchronously.

On CUDA every copy runs on a side stream and the host never waits for one: swap-in is
enqueued layer by layer with one event per layer, and attention of layer i waits for layer
i's event only. A swap-out (this step's, or an ahead-of-time one still running) delays the
forward only if the forward writes a GPU block that copy still reads (`PendingReads`);
otherwise it runs beside the forward.

With an 8-bit KV (`kv_dtype` "fp8" or "int8") each tier holds 8-bit codes in that layout plus
float16 scales [layers, 2, num_blocks, block_size, kv_heads] (one per token and KV head, see
`kernels/quant.py`); a block's scales travel with its codes in every copy.

Swapped chunks are mostly scattered (runs of one block), and a copy per run, layer and K/V
is thousands of small transfers a step. Per direction (`PENSIEVE_SWAP_COPY`), a step's
scattered copies go through one kernel launch per layer (swap-in) or per step (swap-out)
that moves every block (`kernels/triton_swap.py`, reading and writing the page-locked tier
directly), or run by run on the copy engine. The kernel is used where a start-up check
shows it copies exactly, and not for a few long runs (the copy engine's best case). Its
block ids are filled on the host into page-locked staging slots and uploaded without
waiting (`StagingRing`: a slot is rewritten only once its upload ran). On the CPU the same
many runs go as one gather and one scatter of blocks per layer (or per step), not one
Python-issued copy per run, layer and K/V.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from engine.copies import CopyPlan, PendingReads, StagingRing
from engine.kv_layout import KVLayout
from engine.model.shapes import ModelArgs
from kernels.quant import CODE_DTYPE, SCALE_DTYPE, QuantizedKV

log = logging.getLogger(__name__)

KERNEL_RUNS = 4  # this many runs or more go through the kernel (where it copies that way)
LONG_RUN = 8  # fewer runs go through the kernel unless they average this many blocks or more
RING_SLOTS = 8  # staging slots for the kernel's block ids: up to three a step (out, in, background)
DIRECTIONS = ("out", "in")  # GPU -> CPU, CPU -> GPU
SWAP_COPY_ENV = "PENSIEVE_SWAP_COPY"


class KVPool:
    def __init__(
        self,
        args: ModelArgs,
        gpu_blocks: int,
        cpu_blocks: int,
        block_size: int,
        device,
        dtype,
        kv_dtype: str = "auto",
        layout: KVLayout | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.kv_dtype = kv_dtype
        self.layout = layout = KVLayout.of(args, savings=False) if layout is None else layout
        parts = _parts(args, block_size, dtype, kv_dtype)
        layers = layout.slots
        gpu = [
            torch.zeros((layers, 2, gpu_blocks, *shape), device=self.device, dtype=dt)
            for shape, dt in parts
        ]
        cpu = self._host_pool(layers, max(cpu_blocks, 0), parts)
        # Codes (or the KV itself) first, then the scales of an 8-bit KV.
        self.gpu, self.cpu = gpu[0], cpu[0]
        self.gpu_scales = gpu[1] if len(gpu) > 1 else None
        self.cpu_scales = cpu[1] if len(cpu) > 1 else None
        self._tiers = list(zip(gpu, cpu, strict=True))  # (GPU, CPU) tensor pairs every copy moves
        if kv_dtype == "auto":
            slots = [(self.gpu[i, 0], self.gpu[i, 1]) for i in range(layers)]
        else:
            g, s = self.gpu, self.gpu_scales
            slots = [
                tuple(QuantizedKV(g[i, kv], s[i, kv], kv_dtype) for kv in (0, 1))
                for i in range(layers)
            ]
        self.layers = [slots[j] for j in layout.slot_of]  # each model layer's view
        self._copied: set[int] = set()  # the CPU: slots whose swap-in ran this step
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        # Per direction: scattered copies through the kernel in one launch, or run by run on
        # the copy engine (tests turn the kernel on for the CPU under the interpreter).
        chosen = swap_copies(os.environ.get(SWAP_COPY_ENV))
        works = self.cuda and "kernel" in chosen.values() and kernel_copies_work(self.device)
        self.kernel = {d: works and chosen[d] == "kernel" for d in DIRECTIONS}
        self._ring = StagingRing.of(RING_SLOTS)  # the kernel's block ids, staged on the host
        self._reads = PendingReads()  # GPU blocks swap-outs in flight still read
        self._layer_events: list | None = None  # this step's swap-in, one event per layer
        self._layer_event_pool: list | None = None
        self._pending_swap_in: Moves | None = None
        self._pending_load: list[tuple[list, int]] = []  # this step's loads from the disk tier

    def _host_pool(self, layers: int, blocks: int, parts: list[tuple]) -> list[torch.Tensor]:
        """The CPU tier (one tensor per (shape, dtype) part), page-locked on CUDA so copies run
        at full speed and asynchronously. The host can refuse to pin far less than it has free,
        so a pool that cannot be pinned is halved until it can (the engine reads back how many
        blocks it got)."""
        while True:
            pinned: list[torch.Tensor] = []
            try:
                pools = [torch.zeros((layers, 2, blocks, *shape), dtype=dt) for shape, dt in parts]
                for pool in pools:
                    if self.cuda and pool.nbytes:
                        _pin(pool)
                        pinned.append(pool)
                for pool in pinned:
                    weakref.finalize(self, _unpin, pool)
                return pools
            except (RuntimeError, MemoryError):  # torch.AcceleratorError is a RuntimeError
                for pool in pinned:
                    _unpin(pool)
                if blocks <= 1:
                    raise
                log.warning("could not pin %d CPU blocks; trying %d", blocks, blocks // 2)
                blocks //= 2

    @property
    def cpu_blocks(self) -> int:
        """Blocks of the CPU tier: fewer than asked when the host would not pin them all."""
        return self.cpu.shape[2]

    @staticmethod
    def bytes_per_block(
        args: ModelArgs, block_size: int, dtype: torch.dtype, kv_dtype: str = "auto"
    ) -> int:
        """Bytes a chunk of every layer's KV takes in either tier: K and V of every layer,
        with the scales of an 8-bit KV (a tier's size in chunks is in these)."""
        total = 0
        for shape, dt in _parts(args, block_size, dtype, kv_dtype):
            n = args.n_layers * 2 * block_size
            for dim in shape[1:]:
                n *= dim
            total += n * torch.empty((), dtype=dt).element_size()
        return total

    # ---- one step --------------------------------------------------------------------------

    @property
    def bytes_per_chunk(self) -> int:
        """Bytes of a chunk of every layer's KV in either tier (K and V, scales): a page's
        times the pages of every group (what a chunk inside the window holds)."""
        page = sum(g[:, :, 0].nbytes for g, _ in self._tiers)
        return page * self.layout.n_layers // self.layout.slots

    def read_pages(self, tier: str, pages: tuple[int, ...]) -> list[torch.Tensor]:
        """A copy on the host of a chunk's pages (K and V of their slots; and the scales of an
        8-bit KV): a chunk leaving for the disk tier, read before its pages are reused. One
        page: [slots, 2, ...] per part; more (a chunk inside the window): [slots, 2, pages,
        ...]."""
        if self.cuda:
            self.stream.synchronize()  # background swap-outs may still be writing it
        which = 0 if tier == "gpu" else 1
        at = pages[0] if len(pages) == 1 else torch.tensor(pages, device=self.device)
        return [pair[which][:, :, at].to("cpu", copy=True) for pair in self._tiers]

    def _load(self, loads: list[tuple[list, tuple[int, ...]]], slot: int) -> None:
        """One slot of the chunks read back from the disk tier (host tensors, page-locked
        on CUDA) into their GPU pages: pipelined with the forward like a swap-in. A file
        with fewer pages than the chunk was given fills its first (the full layers')."""
        for parts, pages in loads:
            n = parts[0].shape[2] if parts[0].dim() == 6 else 1
            for (g, _), part in zip(self._tiers, parts, strict=True):
                if n == 1:
                    g[slot, :, pages[0]].copy_(part[slot], non_blocking=self.cuda)
                    continue
                for j, page in enumerate(pages[:n]):
                    g[slot, :, page].copy_(part[slot, :, j], non_blocking=self.cuda)

    def begin_step(
        self, plan: CopyPlan, writes: Callable[[], Collection[int]] | None = None
    ) -> None:
        """Before the forward: the swap-outs, then the disk tier's loads and the swap-in
        layer by layer, all on the copy stream and none waited for on the host.

        `writes`: the GPU blocks this step's forward writes KV into (asked only while a
        swap-out is in flight). The forward waits for a swap-out (this step's, or an earlier
        one still running) only if it writes one of the blocks that copy reads; None: not
        known, so it waits for every swap-out in flight."""
        if not self.cuda:
            self._copy_out(plan.swap_out)
            self._copied = set()
            self._pending_swap_in = self._moves(plan.swap_in, "in") if plan.swap_in else None
            self._pending_load = plan.load
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # chunks to copy were written by earlier steps
        with torch.cuda.stream(self.stream):
            if plan.swap_out:
                self._copy_out(plan.swap_out)
                self._reads.add(_recorded(), (g for g, _ in plan.swap_out))
            self._reads.retire()
            if self._reads.batches:
                for fence in self._reads.blocking(None if writes is None else writes()):
                    compute.wait_event(fence)  # on the device: the host goes on
            events = None
            if plan.swap_in or plan.load:  # no events for the usual step without
                moves = self._moves(plan.swap_in, "in")
                events = self._events()
                for slot, ev in enumerate(events):  # the first layers are ready first
                    self._copy_in(moves, slot)
                    self._load(plan.load, slot)
                    ev.record(self.stream)
        self._layer_events = events

    def before_attention(self, layer: int) -> None:
        """Hook called by the model before layer `layer` reads (and writes) its KV: its
        slot's swap-in must be in."""
        slot = self.layout.slot_of[layer]
        if self.cuda:
            if self._layer_events is not None:
                torch.cuda.current_stream(self.device).wait_event(self._layer_events[slot])
        elif slot not in self._copied:
            self._copied.add(slot)
            if self._pending_swap_in is not None:
                self._copy_in(self._pending_swap_in, slot)
            if self._pending_load:
                self._load(self._pending_load, slot)

    def swap_in_now(self) -> None:
        """No forward follows this step's copies: bring every layer's swap-in in now."""
        for layer in range(len(self.layers)):
            self.before_attention(layer)

    def end_step(self, plan: CopyPlan) -> None:
        """After the forward: start the ahead-of-time swap-outs in the background. The next
        forward waits for them only where it writes a block they read."""
        self._pending_swap_in = None
        self._pending_load = []
        if not plan.background:
            return
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                self._copy_out(plan.background)
                self._reads.add(_recorded(), (g for g, _ in plan.background))
        else:
            self._copy_out(plan.background)

    def swap_in_busy(self) -> bool:
        """A swap-in is still being copied (swap-out waits for it: swap-in has priority)."""
        if self._layer_events is None:
            return False
        if self._layer_events[-1].query():
            self._layer_events = None
            return False
        return True

    def _events(self) -> list:
        """One event per slot, made once: recording one again is safe, as a stream that
        waited on it waits on the record that was current when it asked."""
        if self._layer_event_pool is None:
            self._layer_event_pool = [torch.cuda.Event() for _ in range(self.gpu.shape[0])]
        return self._layer_event_pool

    # ---- copies ----------------------------------------------------------------------------

    @property
    def copy_kernel(self) -> bool:
        """Scattered copies go through the block-copy kernel in some direction."""
        return any(self.kernel.values())

    @copy_kernel.setter
    def copy_kernel(self, on: bool) -> None:
        self.kernel = dict.fromkeys(DIRECTIONS, on)

    def _moves(self, pairs: list[tuple[int, int]], direction: str) -> Moves:
        """(src, dst) block pairs as runs, and as id tensors where the kernel will copy them:
        where this direction copies through the kernel, unless the runs are few and long
        (the copy engine moves those fastest, in a few transfers)."""
        moves = Moves(runs(pairs))
        n = len(moves.runs)
        blocks = sum(r[2] for r in moves.runs)
        kernel = self.kernel[direction] and n and (n >= KERNEL_RUNS or blocks < LONG_RUN * n)
        if kernel or (not self.cuda and n >= KERNEL_RUNS):  # the CPU: a gather and a scatter
            moves.ids = self._ids(moves.runs, blocks)
        return moves

    def _ids(self, moves: list[tuple[int, int, int]], n: int) -> tuple[torch.Tensor, ...]:
        """Source and destination block ids of every block of the runs, for the kernel: filled
        on the host into a staging slot, uploaded without waiting (on the copy stream, before
        the kernel that reads them)."""
        slot, grow = self._ring.take(n)
        if grow is not None:
            host = torch.empty((2, grow), dtype=torch.int64, pin_memory=self.cuda)
            dev = torch.empty_like(host, device=self.device) if self.cuda else host
            slot.buffer, slot.capacity = (host, dev), grow
        host, dev = slot.buffer
        ids = [[s + i for s, _, k in moves for i in range(k)],
               [d + i for _, d, k in moves for i in range(k)]]  # fmt: skip
        host[:, :n] = torch.tensor(ids, dtype=torch.int64)  # host memory only
        if self.cuda:
            dev[:, :n].copy_(host[:, :n], non_blocking=True)
            slot.fence = _recorded()  # the slot is rewritten only once this upload ran
        return dev[0, :n], dev[1, :n]

    def _copy_ids(self, src: torch.Tensor, dst: torch.Tensor, moves: Moves, layers: range) -> None:
        """Every block of `moves` (its ids) in `layers`: the kernel, or on the CPU a gather
        and a scatter (the destinations are distinct: `runs` keeps the latest copy of each)."""
        if self.copy_kernel:
            _copy_blocks(src, dst, *moves.ids, layers)
            return
        part = slice(layers.start, layers.stop)
        src_ids, dst_ids = moves.ids  # type: ignore[misc]
        dst[part].index_copy_(2, dst_ids, src[part].index_select(2, src_ids))

    def _copy_out(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        moves = self._moves(pairs, "out")
        if moves.ids is not None:
            for g, c in self._tiers:
                self._copy_ids(g, c, moves, range(g.shape[0]))
            return
        for gpu, cpu, n in moves.runs:
            for layer in range(self.gpu.shape[0]):
                for g, c in self._tiers:
                    for kv in (0, 1):
                        c[layer, kv, cpu : cpu + n].copy_(
                            g[layer, kv, gpu : gpu + n], non_blocking=self.cuda
                        )

    def _copy_in(self, moves: Moves, layer: int) -> None:
        """One layer of a swap-in (its runs and ids worked out once per step)."""
        if moves.ids is not None:
            for g, c in self._tiers:
                self._copy_ids(c, g, moves, range(layer, layer + 1))
            return
        for cpu, gpu, n in moves.runs:
            for g, c in self._tiers:
                for kv in (0, 1):
                    g[layer, kv, gpu : gpu + n].copy_(
                        c[layer, kv, cpu : cpu + n], non_blocking=self.cuda
                    )


@dataclass
class Moves:
    """A step's copies in one direction: (src, dst, length) runs, and the source and
    destination block ids (int64 tensors on the device) when they go all at once (the
    kernel, or the CPU's gather and scatter)."""

    runs: list[tuple[int, int, int]]
    ids: tuple[torch.Tensor, torch.Tensor] | None = None


def _recorded():
    """A new event recorded on the current stream."""
    ev = torch.cuda.Event()
    ev.record()
    return ev


def swap_copies(text: str | None) -> dict[str, str]:
    """How each direction copies scattered blocks, from `PENSIEVE_SWAP_COPY`: "kernel" or
    "dma" for both, or per direction, e.g. "out=dma,in=kernel". Default: the kernel both
    ways (the only one measured in serving so far, on the H100 at 4e07f94; `bench.swap`
    measures both per direction)."""
    out = dict.fromkeys(DIRECTIONS, "kernel")
    for part in (text or "").replace(" ", "").split(","):
        if not part:
            continue
        key, _, val = part.rpartition("=")
        keys = [key] if key else list(DIRECTIONS)
        if val not in ("kernel", "dma") or any(k not in DIRECTIONS for k in keys):
            raise ValueError(
                f"{SWAP_COPY_ENV}={text!r}: want kernel, dma, or e.g. out=dma,in=kernel"
            )
        out.update(dict.fromkeys(keys, val))
    return out


def _copy_blocks(*args) -> None:
    from kernels.triton_swap import copy_blocks  # Triton is imported only where it copies

    copy_blocks(*args)


_KERNEL_WORKS: dict[torch.device, bool] = {}


def kernel_copies_work(device: torch.device) -> bool:
    """Once per device: does the block-copy kernel move scattered blocks GPU -> page-locked
    host -> GPU exactly? Where it does not (no Triton, a driver that refuses host pointers),
    copies go run by run, with one log line."""
    if device not in _KERNEL_WORKS:
        try:
            gpu = torch.randn((2, 2, 4, 8, 16), device=device).to(torch.bfloat16)
            host = torch.zeros((2, 2, 3, 8, 16), dtype=torch.bfloat16).pin_memory()
            back = torch.zeros_like(gpu)
            ids = [torch.tensor(x, dtype=torch.int64, device=device) for x in ([3, 0], [0, 2])]
            _copy_blocks(gpu, host, ids[0], ids[1], range(2))
            _copy_blocks(host, back, ids[1], ids[0], range(2))
            torch.cuda.synchronize(device)
            ok = torch.equal(back[:, :, [3, 0]], gpu[:, :, [3, 0]]) and not back[:, :, 1].any()
        except Exception as e:  # noqa: BLE001 - any failure means: copy run by run
            log.warning(
                "block-copy kernel unavailable on %s (%s): swaps copy run by run", device, e
            )
            ok = False
        else:
            if not ok:
                log.warning(
                    "block-copy kernel copied wrong bytes on %s: swaps copy run by run", device
                )
        _KERNEL_WORKS[device] = ok
    return _KERNEL_WORKS[device]


def _parts(args: ModelArgs, block_size: int, dtype, kv_dtype: str) -> list[tuple]:
    """(shape within [layers, 2, blocks], dtype) of each tensor of a tier."""
    kv = (block_size, args.n_kv_heads, args.head_dim)
    if kv_dtype == "auto":
        return [(kv, dtype)]
    if kv_dtype not in CODE_DTYPE:
        raise ValueError(f"kv_dtype must be auto, fp8 or int8, got {kv_dtype!r}")
    return [(kv, CODE_DTYPE[kv_dtype]), ((block_size, args.n_kv_heads), SCALE_DTYPE)]


def _pin(tensor: torch.Tensor) -> None:
    """Page-lock a host tensor in place. `pin_memory=True` would go through torch's caching
    host allocator, which rounds every request up to a power of two: a 77 GB pool would ask
    for 128 GB."""
    cudart = torch.cuda.cudart()
    portable = 1  # cudaHostRegisterPortable: pinned for every GPU, not only the current one
    err = cudart.cudaHostRegister(tensor.data_ptr(), tensor.nbytes, portable)
    if int(getattr(err, "value", err)) != 0:
        clear = getattr(cudart, "cudaGetLastError", None)
        if clear is not None:
            clear()  # a later kernel launch must not report this error as its own
        raise RuntimeError(f"cudaHostRegister refused {tensor.nbytes} bytes ({err})")


def _unpin(tensor: torch.Tensor) -> None:
    """Unregister before the memory goes back to the host allocator (holds it until then)."""
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


def runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst) block pairs as (src, dst, length) runs consecutive on both sides.

    A block can be the destination twice in one plan (its first chunk was dropped within the
    same step and the block handed out again): only the later copy counts, and dropping the
    earlier one is what makes reordering the copies into runs safe."""
    latest = {dst: src for src, dst in pairs}
    out: list[tuple[int, int, int]] = []
    for src, dst in sorted((src, dst) for dst, src in latest.items()):
        if out and out[-1][0] + out[-1][2] == src and out[-1][1] + out[-1][2] == dst:
            s0, d0, n = out[-1]
            out[-1] = (s0, d0, n + 1)
        else:
            out.append((src, dst, 1))
    return out
