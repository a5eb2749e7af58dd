"""What every benchmark records beside its figures: the machine it ran on and the commit
it measured. Standard library and torch only (no web stack)."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
# Tokenized ShareGPT samples, committed: a GPU machine replays them with no dataset package.
SAMPLES = ROOT / "bench" / "samples"


def git_commit() -> str:
    """HEAD of the checkout, "-dirty" if tracked files differ (results excepted);
    $GIT_COMMIT when set (a copy of the tree without .git)."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
        dirty = subprocess.run(
            # Results written by an earlier benchmark do not change what runs.
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"]
            + ["--", ".", ":!bench/results"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_slug(device: str) -> str:
    """A device's name for file names: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3",
    "cpu (x86_64, 1 threads)" -> "cpu"."""
    return re.sub(r"[^a-z0-9]+", "-", device.split(" (")[0].lower()).strip("-")


def host_memory_gb() -> float | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (ValueError, OSError):
        return None


def device_name(device=None) -> str:
    """The GPU's name, or the CPU's with the threads torch uses."""
    import torch

    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    return f"cpu ({cpu}, {torch.get_num_threads()} threads)"


# The /proc/cpuinfo flags a CPU benchmark's figures depend on (vector width, bf16, int8, AMX).
CPU_FLAGS = (
    "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
    "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8",
)  # fmt: skip


def cpu_info(text: str | None = None) -> dict[str, Any]:
    """The CPU's model name and which of CPU_FLAGS it has, from /proc/cpuinfo (or `text`)."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {"model": platform.processor() or platform.machine(), "flags": {}}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {
        "model": fields.get("model name", platform.processor() or platform.machine()),
        "flags": {f: f in flags for f in CPU_FLAGS},
    }


def environment(device=None) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "machine": platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "git_commit": git_commit(),
        "torch": torch.__version__,
        "device": device_name(device),
    }
    host = host_memory_gb()
    if host is not None:
        env["memory_gb"] = round(host, 1)
    return env


def write_json(path: Path, result: dict[str, Any], indent: int = 1) -> Path:
    """A benchmark's result as JSON at `path` (its folder made)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent) + "\n")
    return path
