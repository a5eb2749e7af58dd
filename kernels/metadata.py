"""Attention metadata: a batch as a list of sub-requests over a paged KV pool."""

from __future__ import annotations

import array
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Sub-request s has queries at rows query_start[s]:query_start[s+1] of the batch,
    its first query at absolute position query_pos[s], and reads its keys through
    block_tables[s]. It attends causally to positions [0, query_pos[s] + q_len_s).

    All three are int32 tensors on the device of the KV pool: [S+1], [S], [S, max_blocks].
    The same object is passed to every layer of a step, so backends may cache what they
    derive from it in `derived`.
    """

    query_start: torch.Tensor
    query_pos: torch.Tensor
    block_tables: torch.Tensor
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return self.query_pos.shape[0]

    def group(self, g: int) -> AttentionMetadata:
        """The metadata of page group `g` when block_tables is [G, S, max_blocks], one table
        per group (engine/kv_layout.py): the same queries through that group's tables."""
        key = ("group", g)
        if key not in self.derived:
            self.derived[key] = AttentionMetadata(
                self.query_start, self.query_pos, self.block_tables[g]
            )
        return self.derived[key]

    @staticmethod
    def build(
        q_lens: list[int], query_pos: list[int], block_tables: list[list[int]], device
    ) -> AttentionMetadata:
        """From plain lists (tests, benchmarks, the cost profile)."""
        starts = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0, out=starts[1:])
        return AttentionMetadata(
            query_start=starts.to(device),
            query_pos=torch.tensor(query_pos, dtype=torch.int32, device=device),
            block_tables=padded_tables(block_tables).to(device),
        )


def padded_tables(tables: list[list[int]], width: int | None = None) -> torch.Tensor:
    """Block tables as one int32 [len(tables), width] tensor, rows padded with block 0 (a
    valid block: padding is never read as a key). `width` defaults to the longest table."""
    lens = [len(t) for t in tables]
    longest = max(lens, default=0)
    if width is None:
        width = max(longest, 1)
    elif width < longest:
        raise ValueError(f"a block table of {longest} blocks does not fit width {width}")
    if not tables:
        return torch.zeros((0, width), dtype=torch.int32)
    flat = array.array("i")
    for t in tables:
        flat.extend(t)
    if len(flat) == len(tables) * width:  # no padding (every table as long as the width)
        return torch.frombuffer(flat, dtype=torch.int32).view(len(tables), width)
    out = torch.zeros((len(tables), width), dtype=torch.int32)
    if flat:
        out[torch.arange(width) < torch.tensor(lens)[:, None]] = torch.frombuffer(
            flat, dtype=torch.int32
        )
    return out
