"""CUDA graphs for steps: one captured forward per bucket of (tokens, sub-requests).

A step of t positions over s pieces (no swap-in or disk load to wait for inside the forward)
is padded up to the smallest captured bucket holding both and replayed from persistent device
buffers: ids, positions, slots, logit rows, query_start, query_pos and block tables of a
fixed width (the most chunks a context can have). Decode buckets are (B, B) for B = 1, 2, 4,
..., 256; mixed buckets (T, S) with T past the largest decode bucket, up to
`cuda_graph_tokens`, take prompt pieces beside decodes (S the largest decode bucket). The
attention kernel's grid needs only the token and sub-request counts (`query_start[s] //
BLOCK_Q + s` programs, each finding its sub-request on the device), so one graph serves any
mix of prompt and decode pieces of its bucket.

Padding does nothing: padded tokens have slot -1 (the KV write skips it), position 0 and
id 0, and belong to no sub-request (rows past query_start[-1] are never written by
attention; every other op is row by row); padded sub-requests have query_start = t (q_len
0: their attention programs exit at once) and block 0 (a valid block, never read). The graph
computes the logits of S rows into one static buffer (padded rows read row 0); the first R
are the wanted ones.

Triton bakes the token and sub-request counts into its grids and specialises on them, so
every bucket is warmed up eagerly (compiling its kernels) right before its capture. The
buckets share one memory pool, captured largest first. Swap waits, the sampler and every
host sync stay outside the graph: steps with a swap-in run eagerly. The ids a lagged step does
not know yet (placeholders) are filled into the device buffer before the replay.

Everything but the capture and replay is plain tensor code: with `capture=False` the same
buffers feed an eager forward (the CPU tests run the padding and the buffers through the
engine that way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.batch import Batch, StepInputs, fill_placeholders
from engine.copies import CopyPlan

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True, order=True)
class Bucket:
    """A captured step shape: `tokens` positions over `seqs` sub-requests (at most)."""

    tokens: int
    seqs: int


def bucket_sizes(max_turns: int) -> list[int]:
    """The decode buckets: up to the first that holds `max_turns` rows (at most 256; a
    larger decode step runs eagerly)."""
    out = []
    for b in BUCKETS:
        out.append(b)
        if b >= max_turns:
            break
    return out


def buckets(max_turns: int, max_tokens: int) -> list[Bucket]:
    """Decode buckets (B, B) for `bucket_sizes(max_turns)`, then mixed buckets (T, top) with
    T doubling past the largest decode bucket up to the first that holds `max_tokens`
    positions (0: decode buckets only)."""
    sizes = bucket_sizes(max_turns)
    out = [Bucket(b, b) for b in sizes]
    top = t = sizes[-1]
    while t < max_tokens:
        t *= 2
        out.append(Bucket(t, top))
    return out


def bucket_for(tokens: int, seqs: int, sizes: list[Bucket]) -> Bucket | None:
    """The smallest bucket that holds `tokens` positions over `seqs` sub-requests; None: none
    does. A step with a prompt piece (more positions than sub-requests) only goes to a mixed
    bucket: decode buckets (B, B) are for decode steps (`cuda_graph_tokens` 0 means that)."""
    for b in sorted(sizes):
        if tokens > seqs and b.tokens == b.seqs:
            continue
        if b.tokens >= tokens and b.seqs >= seqs:
            return b
    return None


def bucket_of(n: int, sizes: list[int]) -> int | None:
    """The smallest decode size that holds n rows; None: none does."""
    for b in sizes:
        if b >= n:
            return b
    return None


def is_decode_only(x: StepInputs, plan: CopyPlan) -> bool:
    """One position per piece and no swap-in (or disk tier load) to wait for inside the
    forward."""
    return bool(x.starts) and len(x.ids) == len(x.starts) and graphable(x, plan)


def graphable(x: StepInputs, plan: CopyPlan) -> bool:
    """A step a graph can run: it has pieces, and no swap-in (or disk tier load) to wait for
    inside the forward."""
    return bool(x.starts) and not (plan.swap_in or plan.load)


def pad(b: Batch, size: int | Bucket) -> Batch:
    """A batch of t positions over s sub-requests as `size` (a decode size n: (n, n)), the
    extra positions and sub-requests inert (module docstring). The block tables keep their
    width; `rows` stays (indices of real rows)."""
    size = size if isinstance(size, Bucket) else Bucket(size, size)
    t, s = b.ids.numel(), b.query_start.numel() - 1
    if t > size.tokens or s > size.seqs:
        raise ValueError(f"{t} positions over {s} sub-requests do not fit {size}")

    def grow(x: torch.Tensor, n: int, value: int) -> torch.Tensor:
        return torch.cat([x, x.new_full((n - x.shape[0], *x.shape[1:]), value)])

    return Batch(
        ids=grow(b.ids, size.tokens, 0),
        positions=grow(b.positions, size.tokens, 0),
        slots=grow(b.slots, size.tokens, -1),
        rows=b.rows,
        query_start=grow(b.query_start, size.seqs + 1, t),
        query_pos=grow(b.query_pos, size.seqs, 0),
        tables=grow(b.tables, size.seqs, 0),
    )


class _Buffers:
    """The fixed layout of the step's inputs for buckets up to `top` (tokens, sub-requests)
    and tables of `width` columns: int64 [ids | positions | slots | rows], int32
    [query_start | query_pos | tables], each bucket reading a prefix of every region."""

    def __init__(self, top: Bucket, width: int, device: torch.device, pinned: bool) -> None:
        self.top, self.width = top, width
        t, s = top.tokens, top.seqs
        self.longs = torch.zeros(3 * t + s, dtype=torch.int64, device=device, pin_memory=pinned)
        self.ints = torch.zeros(
            2 * s + 1 + s * width, dtype=torch.int32, device=device, pin_memory=pinned
        )
        self.done: torch.cuda.Event | None = None  # the last copy out of it (staging only)

    def view(self, size: Bucket) -> Batch:
        """The bucket's inputs; `rows` holds one row per sub-request (the real ones first)."""
        t, s, w, L, i = self.top.tokens, self.top.seqs, self.width, self.longs, self.ints
        return Batch(
            ids=L[: size.tokens],
            positions=L[t : t + size.tokens],
            slots=L[2 * t : 2 * t + size.tokens],
            rows=L[3 * t : 3 * t + size.seqs],
            query_start=i[: size.seqs + 1],
            query_pos=i[s + 1 : s + 1 + size.seqs],
            tables=i[2 * s + 1 : 2 * s + 1 + size.seqs * w].view(size.seqs, w),
        )

    def ints_used(self, size: Bucket) -> int:
        return 2 * self.top.seqs + 1 + size.seqs * self.width


class StepGraphs:
    """The captured step forwards of one runner (its model, pool and backend)."""

    def __init__(
        self,
        model,
        pool,
        backend: str | None,
        sizes: list[Bucket],
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
        top = Bucket(max(b.tokens for b in sizes), max(b.seqs for b in sizes))
        pinned = self.device.type == "cuda"
        self.dev = _Buffers(top, width, self.device, pinned=False)
        self.staging = [_Buffers(top, width, torch.device("cpu"), pinned) for _ in range(2)]
        self._turn = 0
        self.logits = torch.empty((top.seqs, vocab), dtype=torch.float32, device=self.device)
        self.graphs: dict[Bucket, torch.cuda.CUDAGraph] = {}
        self.replays = 0  # steps run through the buckets (tests, metrics)
        self.mixed_replays = 0  # of them, steps with a prompt piece

    def fits(self, x: StepInputs, plan: CopyPlan) -> bool:
        # A step with sliding groups' tables runs eagerly (its buffers hold one group's)
        return (
            not x.group_tables
            and graphable(x, plan)
            and bucket_for(len(x.ids), len(x.starts), self.sizes) is not None
        )

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

    def _forward(self, size: Bucket) -> None:
        """The bucket's forward over the device buffers, into the static logits."""
        b = self.dev.view(size)
        out = self.model(
            b.ids,
            b.positions,
            self.pool.layers,
            b.meta,
            b.slots,
            b.rows,
            before_attention=None,  # no swap-in in a graph step
            backend=self.backend,
        )
        self.logits[: size.seqs].copy_(out)

    # ---- a step -----------------------------------------------------------------------------

    def run(self, b: Batch, sampled: torch.Tensor | None = None) -> torch.Tensor:
        """The logits of `b.rows` for a batch built at this width. `sampled`: the previous
        step's tokens, that the placeholders among the ids stand for."""
        t, s = b.ids.numel(), b.query_start.numel() - 1
        size = bucket_for(t, s, self.sizes)
        if size is None:
            raise ValueError(f"no captured bucket holds {t} positions over {s} sub-requests")
        self._fill(pad(b, size), size)
        if sampled is not None:  # after the staging copy, before the replay
            fill_placeholders(self.dev.longs[: size.tokens], sampled)
        if self.capture_graphs:
            self.graphs[size].replay()
        else:
            self._forward(size)
        self.replays += 1
        self.mixed_replays += t > s
        return self.logits[: b.rows.numel()]

    def _fill(self, b: Batch, size: Bucket) -> None:
        """The padded batch into staging (its rows padded with row 0), then two copies into
        the device buffers."""
        self._turn ^= 1
        stage = self.staging[self._turn]
        if stage.done is not None:
            stage.done.synchronize()  # its previous copy has left it
        view = stage.view(size)
        rows = torch.cat([b.rows, b.rows.new_zeros(size.seqs - b.rows.numel())])
        srcs = [b.ids, b.positions, b.slots, rows] + b.ints()
        for dst, src in zip(view.longs() + view.ints(), srcs, strict=True):
            dst.copy_(src)
        cuda = self.device.type == "cuda"
        self.dev.longs.copy_(stage.longs, non_blocking=cuda)
        used = stage.ints_used(size)
        self.dev.ints[:used].copy_(stage.ints[:used], non_blocking=cuda)
        if cuda:
            stage.done = torch.cuda.Event()
            stage.done.record()
