"""The native CPU kernel (kernels/csrc/paged_decode.cpp), compiled once for this CPU.

Decode attention on the CPU reads its keys straight from the pool's blocks: no gather into a
padded copy and no short-query SDPA, 3-6x faster than the PyTorch path on decode steps. It is
built with the machine's C++ compiler on first use (`-march=native`; the build is cached by
PyTorch's extension loader, keyed by the source) and skipped, with one log line, where that
fails: the PyTorch path then serves.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def module() -> ModuleType | None:
    """The compiled kernel, or None where it cannot be built (no compiler, say) or is turned
    off (PENSIEVE_NATIVE_CPU=0)."""
    if os.environ.get("PENSIEVE_NATIVE_CPU", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(
            name="pensieve_paged_decode",
            sources=[str(SOURCE)],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # a missing compiler or headers: any build error
        log.warning("no native CPU attention kernel (%s); decode attention runs in PyTorch", e)
        return None


def usable(q: torch.Tensor, k_cache) -> bool:
    """The kernel serves this call: CPU tensors of one float32 or bfloat16 dtype."""
    return (
        isinstance(k_cache, torch.Tensor)
        and q.device.type == "cpu"
        and q.dtype in DTYPES
        and k_cache.dtype == q.dtype
        and module() is not None
    )
