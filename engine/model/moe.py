"""Mixture-of-experts MLP (Qwen3-MoE, gpt-oss): a router picks each token's top-k experts,
each expert is a gated MLP, and a token's output is its experts' outputs weighted by the
router. gpt-oss's variant (`ModelArgs.moe_bias`, `routing`, `swiglu_limit`): biases on the
router and the experts, a softmax over the top k logits, a clamped SwiGLU.

A step's (token, expert) pairs are sorted by expert, so that each expert's tokens are one
run of rows. On CUDA in bfloat16 one `torch._grouped_mm` per projection runs every expert
at once, with no host sync (CUDA graphs capture it); elsewhere (the CPU, float32, a torch
without it) one matmul per expert that has tokens, the run lengths read on the host. The
path is chosen once per device and dtype (`pick`).

Compiled (engine/model/compiled.py, the CPU), a layer's experts are one opaque op: the loop's
host-read run lengths would break the graph at every layer and recompile it as they vary.
"""

from __future__ import annotations

import functools
import itertools
import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.families.base import ACTIVATIONS

if TYPE_CHECKING:
    from engine.model.shapes import ModelArgs

log = logging.getLogger(__name__)

# gate, up -> the expert's hidden activations (a gated MLP's act(gate) * up)
Glu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def gated(act: Callable[[torch.Tensor], torch.Tensor]) -> Glu:
    return lambda gate, up: act(gate) * up


def clamped_swiglu(alpha: float, limit: float) -> Glu:
    """gpt-oss's: gate clamped to at most `limit`, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate)."""

    def glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    return glu


def route(
    logits: torch.Tensor, top_k: int, normalize: bool, routing: str = "softmax_topk"
) -> tuple[torch.Tensor, ...]:
    """Each token's top_k experts [T, k] and their weights [T, k] (in the logits' dtype), as
    transformers computes them. "softmax_topk" (Qwen3-MoE): a softmax over all experts in
    float32, then the top k, renormalised to sum to 1 where `normalize` (`norm_topk_prob`).
    "topk_softmax" (gpt-oss): the top k logits, then a softmax over them in their dtype."""
    if routing == "topk_softmax":
        top, experts = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top, dim=-1), experts
    if routing != "softmax_topk":
        raise ValueError(f"unknown routing {routing!r}")
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


Biases = tuple[torch.Tensor, torch.Tensor] | None  # b13 [E, 2I], b2 [E, H]


def _loop(rows: torch.Tensor, ends: torch.Tensor, w13, w2, glu: Glu, bias: Biases):
    """One matmul pair per expert that has rows (`ends`: where each expert's rows end)."""
    out = rows.new_empty(rows.shape[0], w2.shape[1])
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            b13, b2 = (None, None) if bias is None else (bias[0][e], bias[1][e])
            gate, up = F.linear(rows[start:end], w13[e], b13).chunk(2, dim=-1)
            out[start:end] = F.linear(glu(gate, up), w2[e], b2)
        start = end
    return out


def _grouped(rows: torch.Tensor, ends: torch.Tensor, w13, w2, glu: Glu, bias: Biases):
    """Every expert in one grouped matmul per projection (weights [E, out, in], transposed
    views as the kernel wants them); each row's expert's biases gathered and added."""
    offs = ends.to(torch.int32)
    h = torch._grouped_mm(rows, w13.transpose(-2, -1), offs=offs)
    if bias is not None:
        expert = torch.searchsorted(
            ends, torch.arange(rows.shape[0], device=rows.device), right=True
        )
        h = h + bias[0].index_select(0, expert)
    gate, up = h.chunk(2, dim=-1)
    out = torch._grouped_mm(glu(gate, up), w2.transpose(-2, -1), offs=offs)
    return out if bias is None else out + bias[1].index_select(0, expert)


PATHS = {"loop": _loop, "grouped": _grouped}


def experts_forward(
    x: torch.Tensor,  # [T, H]
    weights: torch.Tensor,  # [T, k]
    experts: torch.Tensor,  # [T, k]
    w13: torch.Tensor,  # [E, 2I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor,  # [E, H, I]
    glu: Glu,
    path: str,
    bias: Biases = None,
) -> torch.Tensor:
    t, k = experts.shape
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)  # pair order[j] is row j: grouped by expert
    rows = x.index_select(0, order // k)
    arange = torch.arange(w13.shape[0], device=x.device)
    ends = torch.searchsorted(flat[order], arange, right=True)  # no host sync
    y = PATHS[path](rows, ends, w13, w2, glu, bias) * weights.flatten()[order, None]
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
        b13 = torch.randn(4, 64, device="cuda", dtype=dtype, generator=g)
        b2 = torch.randn(4, 64, device="cuda", dtype=dtype, generator=g)
        glu = gated(F.silu)
        a = _grouped(x, ends, w13, w2, glu, (b13, b2))
        b = _loop(x, ends, w13, w2, glu, (b13, b2))
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


# Every live MoE layer by its key: how the compiled forward's opaque op finds its weights
_MOES: weakref.WeakValueDictionary[int, MoE] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


class MoE(nn.Module):
    """The routed experts of one layer (no shared experts: Qwen3-MoE and gpt-oss have none)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        e, ffn, dim = args.n_experts, args.moe_intermediate_size, args.dim
        self.n_experts, self.top_k, self.normalize = e, args.top_k, args.norm_topk_prob
        self.routing = args.routing
        self.router = nn.Linear(dim, e, bias=args.moe_bias)
        # Stacked as the checkpoint's rows (families/qwen3_moe.py), seen as [E, out, in] when
        # used; each expert's gate rows before its up rows
        self.w13 = nn.Parameter(torch.empty(e * 2 * ffn, dim))
        self.w2 = nn.Parameter(torch.empty(e * dim, ffn))
        if args.moe_bias:  # gpt-oss: each expert's biases, stacked the same way
            self.b13 = nn.Parameter(torch.empty(e * 2 * ffn))
            self.b2 = nn.Parameter(torch.empty(e * dim))
        if args.swiglu_limit is not None:
            self.glu = clamped_swiglu(args.swiglu_alpha, args.swiglu_limit)
        else:
            self.glu = gated(ACTIVATIONS[args.hidden_act])
        self.path: str | None = None  # None: `pick`'s; tests force one
        self.key = next(_KEYS)
        _MOES[self.key] = self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.pensieve.moe(x, self.key)
        return self.apply_to(x)

    def apply_to(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.router(x), self.top_k, self.normalize, self.routing)
        e, h = self.n_experts, x.shape[-1]
        path = self.path or pick(x.device.type, x.dtype)
        w13, w2 = self.w13.view(e, -1, h), self.w2.view(e, h, -1)
        bias = (self.b13.view(e, -1), self.b2.view(e, h)) if hasattr(self, "b13") else None
        return experts_forward(x, weights, experts, w13, w2, self.glu, path, bias)


@torch.library.custom_op("pensieve::moe", mutates_args=())
def moe(x: torch.Tensor, key: int) -> torch.Tensor:
    return _MOES[key].apply_to(x)


@moe.register_fake
def _(x, key):
    return torch.empty_like(x)
