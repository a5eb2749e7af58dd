"""CUDA graphs for decode-only steps: one captured forward per batch-size bucket.

A decode step of n turns (one position each, no swap-in) is padded up to the smallest
captured bucket B >= n and replayed from persistent device buffers: ids, positions, slots,
logit rows, query_start, query_pos and block tables of a fixed width (the most chunks a
context can have). Padding rows do nothing: slot -1 (the KV write skips it), query_start = n
for every padded sub-request (q_len 0: attention exits at once, and rows past
query_start[-1] are never written), position 0 and block 0 (a valid block, never read).
The graph computes the logits of all B rows into one static buffer; the wanted rows are
picked after the replay.

Triton bakes the token and sub-request counts into its grids and specialises on them, so
every bucket is warmed up eagerly (compiling its kernels) right before its capture. The
buckets share one memory pool, captured largest first. Swap waits, the sampler and every
host sync stay outside the graph: steps with a swap-in or any prefill piece run eagerly.

Everything but the capture and replay is plain tensor code: with `capture=False` the same
buffers feed an eager forward (the CPU tests run the padding and the buffers through the
engine that way).
"""

from __future__ import annotations

import torch

from engine.batch import Batch, StepInputs
from engine.copies import CopyPlan

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket_sizes(max_turns: int) -> list[int]:
    """The buckets to capture: up to the first that holds `max_turns` decode rows (at most
    256; a larger decode step runs eagerly)."""
    out = []
    for b in BUCKETS:
        out.append(b)
        if b >= max_turns:
            break
    return out


def bucket_of(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds n rows; None: none does."""
    for b in sizes:
        if b >= n:
            return b
    return None


def is_decode_only(x: StepInputs, plan: CopyPlan) -> bool:
    """One position per piece and no swap-in (or disk tier load) to wait for inside the
    forward."""
    return bool(x.starts) and len(x.ids) == len(x.starts) and not (plan.swap_in or plan.load)


def pad(b: Batch, size: int) -> Batch:
    """A decode-only batch of n rows as `size` rows, the extra rows inert (module docstring).
    The block tables keep their width; `rows` stays (indices of real rows)."""
    n = b.ids.numel()
    extra = size - n
    if extra < 0:
        raise ValueError(f"{n} rows do not fit a bucket of {size}")
    if b.query_start.numel() != n + 1:
        raise ValueError("pad takes decode-only batches (one position per sub-request)")

    def grow(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t, t.new_full((extra, *t.shape[1:]), value)])

    return Batch(
        ids=grow(b.ids, 0),
        positions=grow(b.positions, 0),
        slots=grow(b.slots, -1),
        rows=b.rows,
        query_start=grow(b.query_start, n),
        query_pos=grow(b.query_pos, 0),
        tables=grow(b.tables, 0),
    )


class _Buffers:
    """The fixed layout of the step's inputs for buckets up to `top` rows and tables of
    `width` columns: int64 [ids | positions | slots | rows], int32 [query_start |
    query_pos | tables], each bucket reading a prefix of every region."""

    def __init__(self, top: int, width: int, device: torch.device, pinned: bool) -> None:
        self.top, self.width = top, width
        self.longs = torch.zeros(4 * top, dtype=torch.int64, device=device, pin_memory=pinned)
        self.ints = torch.zeros(
            2 * top + 1 + top * width, dtype=torch.int32, device=device, pin_memory=pinned
        )
        self.done: torch.cuda.Event | None = None  # the last copy out of it (staging only)

    def view(self, size: int, n_rows: int) -> Batch:
        t, w, L, i = self.top, self.width, self.longs, self.ints
        return Batch(
            ids=L[:size],
            positions=L[t : t + size],
            slots=L[2 * t : 2 * t + size],
            rows=L[3 * t : 3 * t + n_rows],
            query_start=i[: size + 1],
            query_pos=i[t + 1 : t + 1 + size],
            tables=i[2 * t + 1 : 2 * t + 1 + size * w].view(size, w),
        )

    def ints_used(self, size: int) -> int:
        return 2 * self.top + 1 + size * self.width


class DecodeGraphs:
    """The captured decode forwards of one runner (its model, pool and backend)."""

    def __init__(
        self,
        model,
        pool,
        backend: str | None,
        sizes: list[int],
        width: int,
        vocab: int,
        capture: bool = True,
    ) -> None:
        self.model, self.pool, self.backend = model, pool, backend
        self.sizes = sorted(sizes)
        self.width = width
        self.device = pool.device
        self.capture_graphs = capture
        if capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        top = self.sizes[-1]
        pinned = self.device.type == "cuda"
        self.dev = _Buffers(top, width, self.device, pinned=False)
        self.staging = [_Buffers(top, width, torch.device("cpu"), pinned) for _ in range(2)]
        self._turn = 0
        self.all_rows = torch.arange(top, device=self.device)  # the graph computes every row
        self.logits = torch.empty((top, vocab), dtype=torch.float32, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0  # steps run through the buckets (tests, metrics)

    def fits(self, x: StepInputs, plan: CopyPlan) -> bool:
        return is_decode_only(x, plan) and len(x.starts) <= self.sizes[-1]

    # ---- capture ----------------------------------------------------------------------------

    def capture(self) -> None:
        """Warm up and capture every bucket, largest first, in one memory pool. The buffers
        hold an all-padding batch meanwhile: the warm-up writes no KV and reads none."""
        empty = Batch(
            *(torch.zeros(0, dtype=torch.int64) for _ in range(4)),
            torch.zeros(1, dtype=torch.int32),
            torch.zeros(0, dtype=torch.int32),
            torch.zeros((0, self.width), dtype=torch.int32),
        )
        pool = torch.cuda.graph_pool_handle() if self.capture_graphs else None
        for size in reversed(self.sizes):
            self._fill(pad(empty, size), size)
            self._forward(size)  # eager: compiles this bucket's kernels
            if not self.capture_graphs:
                continue
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(size)
            self.graphs[size] = graph
        if self.capture_graphs:
            torch.cuda.synchronize(self.device)

    def _forward(self, size: int) -> None:
        """The bucket's forward over the device buffers, into the static logits."""
        b = self.dev.view(size, 0)
        out = self.model(
            b.ids,
            b.positions,
            self.pool.layers,
            b.meta,
            b.slots,
            self.all_rows[:size],
            before_attention=None,  # no swap-in in a decode graph step
            backend=self.backend,
        )
        self.logits[:size].copy_(out)

    # ---- a step -----------------------------------------------------------------------------

    def run(self, b: Batch) -> torch.Tensor:
        """The logits of `b.rows` for a decode-only batch built at this width."""
        n = b.ids.numel()
        size = bucket_of(n, self.sizes)
        if size is None:
            raise ValueError(f"no captured bucket holds {n} rows")
        self._fill(pad(b, size), size)
        if self.capture_graphs:
            self.graphs[size].replay()
        else:
            self._forward(size)
        self.replays += 1
        return self.logits.index_select(0, self.dev.view(size, b.rows.numel()).rows)

    def _fill(self, b: Batch, size: int) -> None:
        """The padded batch into staging, then two copies into the device buffers."""
        self._turn ^= 1
        stage = self.staging[self._turn]
        if stage.done is not None:
            stage.done.synchronize()  # its previous copy has left it
        view = stage.view(size, b.rows.numel())
        for dst, src in zip(view.longs() + view.ints(), b.longs() + b.ints(), strict=True):
            dst.copy_(src)
        cuda = self.device.type == "cuda"
        self.dev.longs.copy_(stage.longs, non_blocking=cuda)
        used = stage.ints_used(size)
        self.dev.ints[:used].copy_(stage.ints[:used], non_blocking=cuda)
        if cuda:
            stage.done = torch.cuda.Event()
            stage.done.record()
