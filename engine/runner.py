"""Turns a step's pieces into tensors, runs the model over the paged pool, samples."""

from __future__ import annotations

import torch

from engine.cache import CopyPlan
from engine.kv_pool import KVPool
from engine.model import Decoder
from engine.sampler import sample
from engine.scheduler import Piece
from kernels import AttentionMetadata


class Runner:
    def __init__(self, model: Decoder, pool: KVPool, chunk_size: int, backend: str | None) -> None:
        self.model = model
        self.pool = pool
        self.chunk_size = chunk_size
        self.backend = backend
        self.device = pool.device

    def step(self, pieces: list[Piece], plan: CopyPlan) -> list[int]:
        """One forward over the unified batch; returns the sampled token of each sampling piece."""
        cs = self.chunk_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_lens, q_pos, tables, rows = [], [], [], []
        params, gens = [], []
        for p in pieces:
            blocks = p.req.table.gpu_blocks(-(-p.end // cs))
            ids += p.req.token_range(p.start, p.end)
            positions += range(p.start, p.end)
            slots += [blocks[i // cs] * cs + i % cs for i in range(p.start, p.end)]
            q_lens.append(p.end - p.start)
            q_pos.append(p.start)
            tables.append(blocks)
            if p.sample:
                rows.append(len(ids) - 1)
                params.append(p.req.turn.sampling)
                gens.append(p.req.generator)
        dev = self.device
        meta = AttentionMetadata.build(q_lens, q_pos, tables, dev)
        self.pool.begin_step(plan)
        logits = self.model(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.pool.layers,
            meta,
            torch.tensor(slots, dtype=torch.long, device=dev),
            torch.tensor(rows, dtype=torch.long, device=dev),
            before_attention=self.pool.before_attention,
            backend=self.backend,
        )
        return sample(logits, params, gens) if rows else []
