"""Turns a step's pieces into tensors, runs the model over the paged pool, samples."""

from __future__ import annotations

import torch

from engine.batch import Batch, StepInputs, Uploader, build, fill_placeholders
from engine.copies import CopyPlan, written_blocks
from engine.graphs import StepGraphs
from engine.guide import Guides, MaskJob, plan_masks
from engine.kv_pool import KVPool
from engine.model.compiled import CompiledForward
from engine.model.decoder import Decoder
from engine.plan import Piece
from engine.sampler import Sampled, Sampler

__all__ = ["Runner", "StepInputs"]


class Runner:
    # Steps may be launched before the previous one's tokens are read (Engine's lagged path)
    runs_ahead = True

    def __init__(self, model: Decoder, pool: KVPool, chunk_size: int, backend: str | None) -> None:
        self.model = model
        self.pool = pool
        model.set_kv_groups(pool.layout.group_of)  # which group's tables each layer reads
        self.groups = pool.layout.groups
        self.chunk_size = chunk_size
        self.backend = backend
        self.device = pool.device
        self.sampler = Sampler(self.device)
        self.upload = Uploader(self.device)
        self.graphs: StepGraphs | None = None  # captured steps (CUDA, triton)
        self.compiled: CompiledForward | None = None  # the compiled CPU forward
        self.guides: Guides | None = None  # constrained decoding (the engine sets it)
        self.overlap_masks = True  # fill a step's masks in a thread during the forward

    def step(self, pieces: list[Piece], plan: CopyPlan) -> list[int]:
        """One forward over the unified batch; returns the sampled token of each sampling piece."""
        x, rows, job = self._inputs(pieces)
        logits = self.forward(x, plan)
        if not x.sample:
            return []
        return self.sampler(logits, *rows, None if job is None else job.result())

    def launch(
        self, pieces: list[Piece], plan: CopyPlan, sampled: torch.Tensor | None = None
    ) -> Sampled | None:
        """`step` without waiting for the device: the tokens come back as a `Sampled` (None:
        no piece samples). `sampled`: the previous step's tokens on the device, which the
        placeholders among the pieces' ids stand for (`Request.run_ahead`)."""
        x, rows, job = self._inputs(pieces)
        holes = any(p.sample and p.req.ahead for p in pieces)
        logits = self.forward(x, plan, sampled if holes else None)
        if not x.sample:
            return None
        mask = None if job is None else job.result()
        return Sampled.of(self.sampler(logits, *rows, mask, False))  # stays on the device

    def _inputs(self, pieces: list[Piece]) -> tuple[StepInputs, tuple[list, list], MaskJob | None]:
        """The step's inputs, the sampling rows' parameters and generators, and the job
        filling their masks (None: no row needs one)."""
        cs = self.chunk_size
        x = StepInputs()
        params, gens, reqs = [], [], []
        for i, p in enumerate(pieces):
            x.ids += p.req.token_range(p.start, p.end)
            x.starts.append(p.start)
            x.ends.append(p.end)
            n = -(-p.end // cs)
            x.tables.append(p.req.table.gpu_blocks(n))
            if self.groups > 1:
                x.group_tables.append(p.req.table.window_blocks(n, self.groups))
            if p.sample:
                x.sample.append(i)
                params.append(p.req.turn.sampling)
                gens.append(p.req.generator)
                reqs.append(p.req)
        job = None
        if self.guides is not None and any(
            r.guide is not None or r.generated < r.turn.sampling.min_tokens for r in reqs
        ):
            rows = [(r.guide, r.generated, r.turn.sampling.min_tokens,
                     r.turn.sampling.stop_token_ids) for r in reqs]  # fmt: skip
            masks = plan_masks(rows, self.guides.stops)
            job = self.guides.masks(masks, self.overlap_masks) if masks else None
        return x, (params, gens), job

    def forward(
        self, x: StepInputs, plan: CopyPlan, sampled: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Start the step's copies, run the model over `x`; the logits of its sampling pieces.
        `sampled`: the previous step's tokens, filled in for the placeholders among the ids."""
        g = self.graphs
        if g is not None and g.fits(x, plan):
            b = build(x, self.chunk_size, g.width)
            self.begin(x, plan)
            return g.run(b, sampled)
        b = self.upload(build(x, self.chunk_size))
        if sampled is not None:
            fill_placeholders(b.ids, sampled)
        self.begin(x, plan)
        return self.run(b)

    def run(self, b: Batch) -> torch.Tensor:
        if self.compiled is not None:
            self.pool.swap_in_now()  # the CPU copies each layer before its attention anyway
            return self.compiled(b)
        return self.model(
            b.ids,
            b.positions,
            self.pool.layers,
            b.meta,
            b.slots,
            b.rows,
            before_attention=self.pool.before_attention,
            backend=self.backend,
        )

    def begin(self, x: StepInputs, plan: CopyPlan) -> None:
        """Before the forward: the step's copies (a tensor-parallel runner also sends the step
        to the other ranks here). The pool learns which blocks the forward writes, so it
        waits only for the swap-outs that read one of them."""
        cs = self.chunk_size

        def writes() -> set[int]:
            return set().union(*(written_blocks(t, x.starts, x.ends, cs) for t in x.by_group()))

        self.pool.begin_step(plan, writes)
