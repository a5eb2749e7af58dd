"""Attention metadata: a batch as a list of sub-requests over a paged KV pool."""

from __future__ import annotations

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

    @staticmethod
    def build(
        q_lens: list[int], query_pos: list[int], block_tables: list[list[int]], device
    ) -> AttentionMetadata:
        """From plain lists (the engine's scheduler output)."""
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        width = max((len(t) for t in block_tables), default=1) or 1
        table = torch.zeros((len(block_tables), width), dtype=torch.int32)
        for i, t in enumerate(block_tables):
            if t:
                table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        return AttentionMetadata(
            query_start=torch.tensor(starts, dtype=torch.int32, device=device),
            query_pos=torch.tensor(query_pos, dtype=torch.int32, device=device),
            block_tables=table.to(device),
        )
