"""CPU only: the model's forward compiled by Inductor (torch.compile) into one graph per step.

Eager, a decode step of a small model is hundreds of small operators issued one by one from
Python; compiled, the elementwise work between the linears is fused into C++ loops. Called
out as opaque ops: each packed linear (engine/model/packed.py: a packed oneDNN weight
cannot be traced, and Inductor's own packing is slower at 16 rows), and attention over the
paged pool, one op per layer that writes the layer's new K/V into the pool and attends
(kernels/reference.py, with the native decode kernel), reading the step's
`AttentionMetadata` from the step that is running.

One graph serves every batch: token and logit-row counts are symbolic, and both are padded
to at least 2 (Dynamo specialises sizes 0 and 1), so no batch shape recompiles. The pool is
static (its tensors never change). `warm_up` compiles at start, not in a user's first step.

The op writes into the pool without declaring it: declared, functionalization would copy
the whole pool per layer to keep the graph pure. Nothing else in the graph reads the pool,
and each layer's op depends on the previous layer's output, so the order is kept.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
from torch.fx.experimental import _config as fx_config

import kernels
from engine.batch import Batch
from engine.model.decoder import Decoder
from kernels.reference import paged_attention_torch, write_kv_torch

log = logging.getLogger(__name__)

_step = threading.local()  # .meta: the AttentionMetadata of the step being run


@torch.library.custom_op("pensieve::attend_paged", mutates_args=())
def attend_paged(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None = None,
    group: int = 0,
) -> torch.Tensor:
    """Writes k, v [T, kv_heads, d] to their slots, then paged attention of q [T, heads, d]
    (within the layer's sliding window, if it has one; with its heads' sinks, if any)
    through its page group's tables."""
    write_kv_torch(k_cache, v_cache, k, v, slots)
    meta = _step.meta
    if meta.block_tables.dim() == 3:
        meta = meta.group(group)
    return paged_attention_torch(q, k_cache, v_cache, meta, scale, window, sinks)


@attend_paged.register_fake
def _(q, k, v, k_cache, v_cache, slots, scale, window, sinks=None, group=0):
    return torch.empty_like(q)


def usable(model: Decoder, layers: list) -> bool:
    """A CPU model over plain tensor pools (an 8-bit pool is not a tensor: eager)."""
    return model.embed.weight.device.type == "cpu" and all(
        isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) for k, v in layers
    )


def _pad(t: torch.Tensor, fill: int) -> torch.Tensor:
    """A copy with at least 2 entries, made under inference mode like every input (Dynamo
    guards on how a tensor was made). Extra ids and positions (fill 0) are inert: slot -1 is
    never written, and a row past query_start[-1] belongs to no sub-request; an extra logit
    row (row 0) is cut off after the forward. Slots of page groups [G, T]: along T."""
    if t.shape[-1] >= 2:
        return t.clone()
    return torch.cat([t, t.new_full((*t.shape[:-1], 2 - t.shape[-1]), fill)], dim=-1)


class CompiledForward:
    """`Decoder.forward` over the pool's layers, compiled once for every batch shape."""

    def __init__(self, model: Decoder, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.model = model
        self.layers = layers
        # Cached before tracing: no guard on the cache (Gemma 3: the local layers' too).
        for local in (False, True) if model.args.rope_local_theta is not None else (False,):
            model.inv_freq(torch.device("cpu"), local)
        for k, v in layers:
            torch._dynamo.mark_static(k)
            torch._dynamo.mark_static(v)
        self.compiled = torch.compile(self._forward, dynamic=True)

    def _forward(self, ids, positions, slots, rows) -> torch.Tensor:
        return Decoder.forward.__wrapped__(
            self.model, ids, positions, self.layers, None, slots, rows
        )

    def __call__(self, b: Batch) -> torch.Tensor:
        import torch._inductor.config as inductor_config  # 1.4 s to import: only once compiling

        n = b.rows.numel()
        _step.meta = b.meta
        try:
            # Freezing: the weights left (norms, embeddings) as constants. No duck sizing: a
            # row count equal to a pool dimension by chance must not specialise the graph.
            # Floats (the model's eps, scales, RoPE bases: fixed) as constants: traced as
            # symbols, they make Dynamo trace the whole forward a second time.
            with (
                torch.inference_mode(),
                inductor_config.patch(freezing=True),
                fx_config.patch(use_duck_shape=False),
                torch._dynamo.config.patch(specialize_float=True),
            ):
                logits = self.compiled(
                    _pad(b.ids, 0), _pad(b.positions, 0), _pad(b.slots, -1), _pad(b.rows, 0)
                )
        finally:
            _step.meta = None
        return logits[:n]

    def warm_up(self) -> None:
        """Compile now, on a 3-token prompt with 2 logit rows that writes nothing (slot -1)
        and reads block 0 (whatever it holds: the logits are dropped). With page groups, the
        slots and tables of each, as every step has them: the graph a step runs."""
        t0 = time.perf_counter()
        meta = kernels.AttentionMetadata.build([3], [0], [[0]], "cpu")
        slots, tables = torch.full((3,), -1), meta.block_tables
        groups = max(self.model.kv_groups, default=0) + 1
        if groups > 1:
            slots, tables = slots.expand(groups, -1), tables.expand(groups, -1, -1)
        self(
            Batch(
                ids=torch.tensor([1, 2, 3]),
                positions=torch.arange(3),
                slots=slots.contiguous(),
                rows=torch.tensor([1, 2]),
                query_start=meta.query_start,
                query_pos=meta.query_pos,
                tables=tables.contiguous(),
            )
        )
        log.info("compiled the CPU forward in %.0f s", time.perf_counter() - t0)
