"""The native CPU kernel (kernels/csrc/paged_decode.cpp), compiled once for this CPU.

Decode attention on the CPU reads its keys straight from the pool's blocks: no gather into a
padded copy and no short-query SDPA, 3-6x faster than the PyTorch path on decode steps. It is
built with the machine's C++ compiler on first use (`-march=native`; the build is cached by
PyTorch's extension loader, keyed by the source) and skipped, with one log line, where that
fails: the PyTorch path then serves. Its build directory is named by a hash of the source, so
two checkouts of different sources on one machine do not load each other's builds.

The loader serialises builds with a lock file in the build directory and waits for it
without limit, so a process killed mid-build would hang every later engine at its first
decode step; a lock older than any build (`STALE_LOCK_S`) is removed first.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
DTYPES = (torch.float32, torch.bfloat16)
# Named by its source: checkouts with different sources (an older one has another signature)
# never share a build directory, where one's build would be loaded by the other.
NAME = "pensieve_paged_decode_" + hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
STALE_LOCK_S = 600.0  # a build takes about a minute on 2 cores


@functools.cache
def module() -> ModuleType | None:
    """The compiled kernel, or None where it cannot be built (no compiler, say) or is turned
    off (PENSIEVE_NATIVE_CPU=0)."""
    if os.environ.get("PENSIEVE_NATIVE_CPU", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import get_default_build_root, load

        root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
        # one directory per source: checkouts of other versions never load each other's build
        digest = hashlib.sha1(SOURCE.read_bytes()).hexdigest()[:10]
        build = Path(root) / f"py{sys.version_info.major}{sys.version_info.minor}_pensieve"
        build = build / f"{NAME}_{digest}"
        build.mkdir(parents=True, exist_ok=True)
        clear_stale_lock(build / "lock")
        return load(
            name=f"{NAME}_{digest}",
            sources=[str(SOURCE)],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=False,
        )
    except Exception as e:  # a missing compiler or headers: any build error
        log.warning("no native CPU attention kernel (%s); decode attention runs in PyTorch", e)
        return None


def clear_stale_lock(lock: Path, now: float | None = None) -> bool:
    """Remove a build lock left by a process killed mid-build (older than any build).
    Returns whether one was removed."""
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age <= STALE_LOCK_S:
        return False  # a build in progress, in another process: wait for it
    log.warning("removing a stale build lock (%.0f s old, a build killed midway?): %s", age, lock)
    lock.unlink(missing_ok=True)
    return True


def usable(q: torch.Tensor, k_cache) -> bool:
    """The kernel serves this call: CPU tensors of one float32 or bfloat16 dtype."""
    return (
        isinstance(k_cache, torch.Tensor)
        and q.device.type == "cpu"
        and q.dtype in DTYPES
        and k_cache.dtype == q.dtype
        and module() is not None
    )
