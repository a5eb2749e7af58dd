"""A step's batch: the compact per-piece lists (what a tensor-parallel step sends to every
rank) and the tensors the model reads, built by tensor ops from them (no per-token Python)
and uploaded in two copies from page-locked staging on CUDA."""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kernels import AttentionMetadata
from kernels.metadata import padded_tables


@dataclass
class StepInputs:
    """A step's batch as plain per-piece lists: nothing of the requests, nothing per position
    but the token ids. Piece i computes positions [starts[i], ends[i]) through its GPU blocks
    tables[i]; the pieces in `sample` want the next-token logits of their last position."""

    ids: list[int] = field(default_factory=list)  # every piece's tokens, piece after piece
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    tables: list[Sequence[int]] = field(default_factory=list)  # int lists or int32 arrays
    sample: list[int] = field(default_factory=list)  # indices of the sampling pieces
    # A layout with sliding groups (engine/kv_layout.py): per piece, the tables of groups 1..
    # (tables[i] is group 0's); empty with one group
    group_tables: list[list[Sequence[int]]] = field(default_factory=list)

    def by_group(self) -> list[list[Sequence[int]]]:
        """Every piece's table, group by group: [group][piece]."""
        return [self.tables, *(list(g) for g in zip(*self.group_tables, strict=True))]


@dataclass
class Batch:
    """The model's inputs: int64 ids, positions, flat KV slots [T] and logit rows [R]; int32
    query_start [S+1], query_pos [S] and block tables [S, W] (kernels.AttentionMetadata).
    With sliding groups (engine/kv_layout.py) the slots are [G, T] and the tables [G, S, W],
    one of each per group."""

    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    rows: torch.Tensor
    query_start: torch.Tensor
    query_pos: torch.Tensor
    tables: torch.Tensor

    @property
    def meta(self) -> AttentionMetadata:
        return AttentionMetadata(self.query_start, self.query_pos, self.tables)

    def longs(self) -> list[torch.Tensor]:
        return [self.ids, self.positions, self.slots, self.rows]

    def ints(self) -> list[torch.Tensor]:
        return [self.query_start, self.query_pos, self.tables]


def _longs(values: list[int]) -> torch.Tensor:
    return torch.frombuffer(array.array("q", values), dtype=torch.int64) if values else _empty()


def _empty() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.int64)


def build(x: StepInputs, chunk_size: int, width: int | None = None) -> Batch:
    """The step's tensors on the CPU. `width`: columns of the block tables (default: the
    longest table)."""
    n, t = len(x.starts), len(x.ids)
    start, end = _longs(x.starts), _longs(x.ends)
    q_lens = end - start
    query_start = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(q_lens, 0, out=query_start[1:])
    if t == n:  # decode-only: one position per piece
        piece, positions = torch.arange(n), start
    else:
        piece = torch.repeat_interleave(torch.arange(n), q_lens, output_size=t)
        positions = torch.arange(t) + (start - query_start[:-1]).index_select(0, piece)
    tables = padded_tables(x.tables, width)
    if x.group_tables:
        width = tables.shape[1]
        groups = zip(*x.group_tables, strict=True)
        tables = torch.stack([tables, *(padded_tables(list(g), width) for g in groups)])
    # slot = block of the position's chunk * chunk_size + offset in the chunk
    flat = tables.view(-1, tables.shape[-2] * tables.shape[-1])
    blocks = flat.index_select(1, piece * tables.shape[-1] + positions // chunk_size)
    slots = (blocks.long() * chunk_size + positions % chunk_size).view(*tables.shape[:-2], -1)
    last = query_start[1:] - 1
    rows = last if len(x.sample) == n else last.index_select(0, _longs(x.sample))
    return Batch(
        ids=_longs(x.ids),
        positions=positions,
        slots=slots,
        rows=rows,
        query_start=query_start.int(),
        query_pos=start.int(),
        tables=tables,
    )


def fill_placeholders(ids: torch.Tensor, sampled: torch.Tensor) -> None:
    """Replace, in place and on the device, each placeholder id -1 - r (a token the host has
    not seen yet: engine/request.py) with row r of the previous step's `sampled` tokens."""
    rows = ids.neg().sub_(1).clamp_(min=0)  # real ids read row 0 and are kept
    ids.copy_(torch.where(ids < 0, sampled.index_select(0, rows), ids))


class _Staging:
    """A page-locked host buffer and the event of the last copy out of it."""

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        self.host = torch.empty(numel, dtype=dtype, pin_memory=True)
        self.done: torch.cuda.Event | None = None


class Uploader:
    """Puts a CPU `Batch` on the device: its int64 parts and its int32 parts in one
    non-blocking copy each, from page-locked staging (two of each, used in turn: the host
    may fill one while the previous step's copy is still queued) into persistent device
    buffers. On the CPU the batch is used as built."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._staging: dict[torch.dtype, list[_Staging]] = {torch.int64: [], torch.int32: []}
        self._turn = 0
        self._dev: dict[torch.dtype, torch.Tensor] = {}

    def __call__(self, b: Batch) -> Batch:
        if not self.cuda:
            return b
        self._turn ^= 1
        ids, positions, slots, rows = self.upload(b.longs(), torch.int64)
        qs, qp, tables = self.upload(b.ints(), torch.int32)
        slots, tables = slots.view(b.slots.shape), tables.view(b.tables.shape)
        return Batch(ids, positions, slots, rows, qs, qp, tables)

    def upload(self, parts: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        sizes = [p.numel() for p in parts]
        n = sum(sizes)
        stage = self._stage(dtype, n)
        if stage.done is not None:
            stage.done.synchronize()  # its previous copy has left the buffer
        torch.cat([p.reshape(-1) for p in parts], out=stage.host[:n])
        dev = self._dev.get(dtype)
        if dev is None or dev.numel() < n:
            # the old buffer goes back to the stream-ordered allocator: a step still
            # reading it finishes first
            dev = self._dev[dtype] = torch.empty(
                max(n, 2 * (0 if dev is None else dev.numel())), dtype=dtype, device=self.device
            )
        dev[:n].copy_(stage.host[:n], non_blocking=True)
        stage.done = torch.cuda.Event()
        stage.done.record()
        return list(dev[:n].split(sizes))

    def _stage(self, dtype: torch.dtype, n: int) -> _Staging:
        pair = self._staging[dtype]
        while len(pair) < 2:
            pair.append(_Staging(1024, dtype))
        stage = pair[self._turn]
        if stage.host.numel() < n:
            if stage.done is not None:
                stage.done.synchronize()
            stage = pair[self._turn] = _Staging(max(n, 2 * stage.host.numel()), dtype)
        return stage
