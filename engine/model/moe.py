"""Mixture-of-experts MLP (Qwen3-MoE): a router picks each token's top-k experts, each expert
is a gated MLP, and a token's output is its experts' outputs weighted by the router.

A step's (token, expert) pairs are sorted by expert, so that each expert's tokens are one
run of rows. On CUDA in bfloat16 one `torch._grouped_mm` per projection runs every expert
at once, with no host sync (CUDA graphs capture it); elsewhere (the CPU, float32, a torch
without it) one matmul per expert that has tokens, the run lengths read on the host. The
path is chosen once per device and dtype (`pick`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.families.base import ACTIVATIONS

if TYPE_CHECKING:
    from engine.model.shapes import ModelArgs

log = logging.getLogger(__name__)

Act = Callable[[torch.Tensor], torch.Tensor]


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, ...]:
    """Each token's top_k experts [T, k] and their weights [T, k] (in the logits' dtype): a
    softmax over all experts in float32, then the top k, renormalised to sum to 1 where
    `normalize` (Qwen3-MoE's `norm_topk_prob`), as transformers computes them."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def _loop(rows: torch.Tensor, ends: torch.Tensor, w13, w2, act: Act) -> torch.Tensor:
    """One matmul pair per expert that has rows (`ends`: where each expert's rows end)."""
    out = rows.new_empty(rows.shape[0], w2.shape[1])
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            gate, up = F.linear(rows[start:end], w13[e]).chunk(2, dim=-1)
            out[start:end] = F.linear(act(gate) * up, w2[e])
        start = end
    return out


def _grouped(rows: torch.Tensor, ends: torch.Tensor, w13, w2, act: Act) -> torch.Tensor:
    """Every expert in one grouped matmul per projection (weights [E, out, in], transposed
    views as the kernel wants them)."""
    offs = ends.to(torch.int32)
    gate, up = torch._grouped_mm(rows, w13.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(act(gate) * up, w2.transpose(-2, -1), offs=offs)


PATHS = {"loop": _loop, "grouped": _grouped}


def experts_forward(
    x: torch.Tensor,  # [T, H]
    weights: torch.Tensor,  # [T, k]
    experts: torch.Tensor,  # [T, k]
    w13: torch.Tensor,  # [E, 2I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor,  # [E, H, I]
    act: Act,
    path: str,
) -> torch.Tensor:
    t, k = experts.shape
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)  # pair order[j] is row j: grouped by expert
    rows = x.index_select(0, order // k)
    arange = torch.arange(w13.shape[0], device=x.device)
    ends = torch.searchsorted(flat[order], arange, right=True)  # no host sync
    y = PATHS[path](rows, ends, w13, w2, act) * weights.flatten()[order, None]
    out = torch.empty_like(y).index_copy_(0, order, y)  # back to (token, k) order
    return out.view(t, k, -1).sum(dim=1)  # a fixed order of adds: deterministic on CUDA


@functools.cache
def pick(device_type: str, dtype: torch.dtype) -> str:
    """ "grouped" where `torch._grouped_mm` runs here and agrees with the loop (CUDA,
    bfloat16), else "loop"; asked once per device and dtype."""
    if device_type != "cuda" or dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return "loop"
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(24, 64, device="cuda", dtype=dtype, generator=g)
        w13 = torch.randn(4, 64, 64, device="cuda", dtype=dtype, generator=g) / 8
        w2 = torch.randn(4, 64, 32, device="cuda", dtype=dtype, generator=g) / 8
        ends = torch.tensor([5, 5, 17, 24], device="cuda")  # an expert without rows
        a, b = (_grouped(x, ends, w13, w2, F.silu), _loop(x, ends, w13, w2, F.silu))
        if torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2):
            return "grouped"
        log.warning("torch._grouped_mm disagrees with the loop here: experts run one by one")
    except (RuntimeError, NotImplementedError) as e:
        log.warning("no grouped experts (%s): they run one by one", e)
    return "loop"


def graph_safe(n_experts: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether CUDA graphs can capture this model's steps: the loop reads run lengths on
    the host, which no capture allows."""
    return n_experts == 0 or pick(device.type, dtype) == "grouped"


class MoE(nn.Module):
    """The routed experts of one layer (no shared experts: Qwen3-MoE has none)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        e, ffn, dim = args.n_experts, args.moe_intermediate_size, args.dim
        self.n_experts, self.top_k, self.normalize = e, args.top_k, args.norm_topk_prob
        self.router = nn.Linear(dim, e, bias=False)
        # Stacked as the checkpoint's rows (families/qwen3_moe.py), seen as [E, out, in] when used
        self.w13 = nn.Parameter(torch.empty(e * 2 * ffn, dim))
        self.w2 = nn.Parameter(torch.empty(e * dim, ffn))
        self.act = ACTIVATIONS[args.hidden_act]
        self.path: str | None = None  # None: `pick`'s; tests force one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.router(x), self.top_k, self.normalize)
        e, h = self.n_experts, x.shape[-1]
        path = self.path or pick(x.device.type, x.dtype)
        w13, w2 = self.w13.view(e, -1, h), self.w2.view(e, h, -1)
        return experts_forward(x, weights, experts, w13, w2, self.act, path)
