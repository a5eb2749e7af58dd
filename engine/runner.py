"""Turns a step's pieces into tensors, runs the model over the paged pool, samples."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.cache import CopyPlan
from engine.kv_pool import KVPool
from engine.model import Decoder
from engine.sampler import Sampler
from engine.scheduler import Piece
from kernels import AttentionMetadata


@dataclass
class StepInputs:
    """A step's batch as plain lists: what the model needs, nothing of the requests (a
    tensor-parallel engine sends it to every rank)."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # flat KV slot of each token
    q_lens: list[int] = field(default_factory=list)
    q_pos: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)  # GPU blocks of each piece
    rows: list[int] = field(default_factory=list)  # tokens whose next-token logits are wanted


class Runner:
    def __init__(self, model: Decoder, pool: KVPool, chunk_size: int, backend: str | None) -> None:
        self.model = model
        self.pool = pool
        self.chunk_size = chunk_size
        self.backend = backend
        self.device = pool.device
        self.sampler = Sampler(self.device)

    def step(self, pieces: list[Piece], plan: CopyPlan) -> list[int]:
        """One forward over the unified batch; returns the sampled token of each sampling piece."""
        cs = self.chunk_size
        x = StepInputs()
        params, gens = [], []
        for p in pieces:
            blocks = p.req.table.gpu_blocks(-(-p.end // cs))
            x.ids += p.req.token_range(p.start, p.end)
            x.positions += range(p.start, p.end)
            x.slots += [blocks[i // cs] * cs + i % cs for i in range(p.start, p.end)]
            x.q_lens.append(p.end - p.start)
            x.q_pos.append(p.start)
            x.tables.append(blocks)
            if p.sample:
                x.rows.append(len(x.ids) - 1)
                params.append(p.req.turn.sampling)
                gens.append(p.req.generator)
        logits = self.forward(x, plan)
        return self.sampler(logits, params, gens) if x.rows else []

    def forward(self, x: StepInputs, plan: CopyPlan) -> torch.Tensor:
        """Start the step's copies, run the model over `x`; the logits of `x.rows`."""
        dev = self.device
        meta = AttentionMetadata.build(x.q_lens, x.q_pos, x.tables, dev)
        self.begin(x, plan)
        return self.model(
            torch.tensor(x.ids, dtype=torch.long, device=dev),
            torch.tensor(x.positions, dtype=torch.long, device=dev),
            self.pool.layers,
            meta,
            torch.tensor(x.slots, dtype=torch.long, device=dev),
            torch.tensor(x.rows, dtype=torch.long, device=dev),
            before_attention=self.pool.before_attention,
            backend=self.backend,
        )

    def begin(self, x: StepInputs, plan: CopyPlan) -> None:
        """Before the forward: the step's copies (a tensor-parallel runner also sends the step
        to the other ranks here)."""
        self.pool.begin_step(plan)
