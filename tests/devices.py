"""Marks for tests that run on a CUDA GPU: `-m gpu` selects them, and they skip without one.

A test file that uses these is collected by `pytest -m gpu` on a bare GPU machine
(tests/conftest.py), so it must import nothing of the web stack."""

from __future__ import annotations

import pytest
import torch

gpu = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def fp8_on_cuda() -> bool:
    """e4m3 conversions in Triton need compute capability 8.9 (Ada, Hopper) or newer."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


fp8 = pytest.mark.skipif(not fp8_on_cuda(), reason="fp8 needs a GPU of compute capability 8.9+")
# A test over both devices: the CPU case runs everywhere, the CUDA one on a GPU.
DEVICES = ["cpu", pytest.param("cuda", marks=[gpu, cuda])]
