"""CPU only: Linear weights pre-packed for oneDNN.

On x86 the default float32 path (BLAS sgemm) is slow for the few-row matmuls of decode
steps: 12 rows cost 3x one row. oneDNN with weights reordered once into its blocked layout
runs them about twice as fast and large prefill matmuls as fast as before. Inference
compilers do the same ("freezing"); this does it for the engine's own model, eagerly.
bfloat16 weights are packed the same way where the CPU computes in bfloat16 natively
(AVX512-BF16 or AMX): a decode step's matmuls then take about half the float32 time.
"""

from __future__ import annotations

import functools
import itertools
import logging
import weakref
from collections.abc import Callable

import torch
from torch import nn

log = logging.getLogger(__name__)

BATCH_HINT = 16  # the row count oneDNN picks its weight layout for: a decode batch


# Every live packed linear by its key: how the compiled forward's opaque op finds its weight
# (an OpaqueLinear: a PackedLinear, or engine/model/fp16.py's Fp16Linear)
_PACKED: weakref.WeakValueDictionary[int, OpaqueLinear] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


class OpaqueLinear(nn.Module):
    """A linear whose weight the compiler cannot trace: compiled, it is one opaque op that
    finds the module by its key and calls its `apply_to`."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.key = next(_KEYS)
        _PACKED[self.key] = self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.pensieve.packed_linear(x, self.key, self.out_features)
        return self.apply_to(x)

    def apply_to(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class PackedLinear(OpaqueLinear):
    """y = x W^T (+ b) with W held only in oneDNN's packed layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear.in_features, linear.out_features)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def apply_to(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed, self.bias, "none", [], ""
        )


@torch.library.custom_op("pensieve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return _PACKED[key].apply_to(x)


@packed_linear.register_fake
def _(x, key, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@functools.cache
def available(dtype: torch.dtype = torch.float32) -> bool:
    """oneDNN is built in, packs `dtype` natively on this CPU, and its packed linear agrees
    with F.linear here."""
    if dtype not in TOLERANCE or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        log.info("no packed bfloat16 linears: the CPU lacks native bfloat16")
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        lin = nn.Linear(64, 48, bias=False).to(dtype)
        nn.init.normal_(lin.weight, generator=gen)
        x = torch.randn(5, 64, generator=gen).to(dtype)
        tol = TOLERANCE[dtype]
        return torch.allclose(PackedLinear(lin)(x), lin(x), rtol=tol, atol=tol)
    except (RuntimeError, AttributeError) as e:  # an op missing from this build
        log.info("no packed CPU linears: %s", e)
        return False


def swap_cpu_linears(
    model: nn.Module, takes: Callable[[torch.dtype], bool], make: Callable[[nn.Linear], nn.Module]
) -> int:
    """Each CPU nn.Linear of `model` whose weight dtype `takes` becomes `make(linear)`;
    returns how many."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
        and child.weight.device.type == "cpu"
        and takes(child.weight.dtype)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, make(child))
    return len(swaps)


def pack_linears(model: nn.Module) -> int:
    """Swap each float32 or bfloat16 CPU nn.Linear of `model` for a PackedLinear where this
    CPU packs its dtype; returns how many."""
    return swap_cpu_linears(model, available, PackedLinear)
