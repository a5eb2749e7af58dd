"""The simulated devices: each constant traced to a committed measurement or a spec sheet.

- `h100`: an H100 80GB HBM3 (SXM), from this project's own measurements on one:
  - `bench/results/kernel-nvidia-h100-80gb-hbm3.json`: the paged attention kernel. Decode
    points fit time = launch + KV bytes / bandwidth (a least-squares line, refitted without
    outliers); the best multi-token/mixed rate is the prefill attention FLOP/s; the best
    decode bandwidth is the achieved HBM read rate for weights.
  - `bench/results/swap-NVIDIA_H100_80GB_HBM3.json`: swap-in and swap-out GB/s through the
    engine's pool, the share of a swap-in hidden behind a 2048-token prefill, and that
    prefill's forward time, which sets the per-token cost of everything but matmuls and
    attention (norms, RoPE, activations, residuals: the engine does not fuse them yet).
  - Matmul: the spec sheet's 989 TFLOP/s dense bf16 at the 81% (798 TFLOP/s) that the best
    bf16 matmul reached on the lent H100 (`bench.mfu`'s probe; `make gpu-check` records it
    in `bench/results/gpu-report-*.json`); half of it at 64 tokens per step (assumed: the
    usual shape of cuBLAS efficiency against M at N, K of 5k-14k).
  - The host's work a step (`H100_STEP_HOST_S`, `H100_ROW_HOST_S`): what real serving
    steps took beyond the model. A GPU report's serve runs record their wall time and steps
    (`counters`); each run's twin (`bench.sim --gpu-report`: the same run in virtual time)
    gives the model's time for its own steps, host time apart. The difference per step is
    the host time the real run implies (`bench.sim.step_ms`), against the run's sampled
    rows per step; a least-squares line through them, neither part negative
    (`bench.sim.host_fit`), over twelve runs: the six of the H100 report at 4e07f94
    (`bench/results/h100-4e07f94/`: 75-82 rows a step, a full queue; 4.1-9.4 ms implied)
    and the stateless and gpu runs of the H200 report at ba0cc72 (5-34 rows; 0.9-2.4 ms).
    Its pensieve run is left out: its swaps went block by block then (1,360 small copies
    a swap-in step), which the engine no longer does. The fit is 0.083 ms per row and no
    part per step (its intercept: -0.01 ms): the model's forward has a fixed part already
    (the attention kernel's launch as the kernel benchmark measured it, 3.5 ms a step,
    where a captured decode step pays less). Per row: its piece of the batch, its
    scheduling, its sampled token accepted and handed to the event loop (a thread that
    takes the GIL too). It replaces the batch metadata alone
    (`bench/results/step_prep_cpu.json`: 0.66 ms for 64 pieces on a 2-core CPU). The host
    works before the forward, while the copy stream goes on.
- `a100-80gb`: the paper's GPU. Spec sheet (A100 SXM 80GB): 312 TFLOP/s dense bf16, 2.039
  TB/s HBM2e, PCIe 4.0 x16 (32 GB/s a direction). Achieved shares are taken from the H100's
  (matmul 81% of peak, attention and weights' reads the same share of HBM, swaps the same
  share of the link: 52.3 of PCIe 5's 64 GB/s), a stated assumption until one is measured.
  The host's time a step is the H100's (the host's, not the GPU's).
- `h200`: an H200 (141 GB HBM3e), from this project's first GPU report on one
  (`bench/results/gpu-report-nvidia-h200.json`, at ba0cc72):
  - its `mfu` part: the best bf16 matmul (797 TFLOP/s, the probe's `matmul_flops_per_s`),
    and the 2048-token prefill forward (4 prompts in 0.317 s), which sets the per-token
    cost of the unfused elementwise work as the H100's swap forward does;
  - its `decode` part: the weights' read rate is the 4 GiB device copy's (4262 GB/s,
    `hbm.bytes_per_s`); its decode step times are the check (`bench/README.md`).
  The report measures neither the attention kernel nor swaps: the kernel's fit (launch,
  KV bytes/s, prefill FLOP/s) and the swap rates over PCIe 5 (and the share of a swap-in
  hidden) are the H100's, as measured there. The H200's faster HBM makes attention
  pessimistic here; its link is the H100's (PCIe 5 x16), so the swaps should hold. The
  host's time a step is the H100's, whose fit takes this report's serving runs too.
- `cpu`: fitted on the machine it runs on (`engine/calibrate.py`), whole measured steps;
  its eviction policy's Cost(l) is the real engine's profile on that machine.
- The disk tier's drive, on every device: one datacenter NVMe SSD, a Samsung PM9A3 U.2
  (PCIe 4.0 x4): 6.5 GB/s sequential read, 3.5 GB/s sequential write (Samsung's figures at
  its launch). An assumption until a server's drive is measured: a GPU server often has
  several (striped, faster); the `cpu` device's machine has whatever it has, not measured.

`VERSIONS`: a device's goes up whenever one of its figures or its model changes; every
simulated result names it. (cpu v2: decodes padded to the step's longest context; v2 of
the GPUs and v3 of cpu: the disk tier's drive; cpu v4: the calibration also times steps
where a prompt joins decodes, as most serving steps do; cpu v5: the policy's Cost(l) is the
real engine's measured profile, not one derived from the fit; h100 v3, a100-80gb v3, h200
v2: the host's time per step measured on the H100 report's serving runs, apart from the
forward and beside the copy stream, and a forward that waits for the last step's
ahead-of-time swap-outs as the real pool's does.)
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from engine.cache.policy import CostModel
from engine.model.loader import model_args
from engine.sim.cost import Features, GPUSpec, Roofline, Shape, StepCost, Work

VERSIONS = {"h100": 3, "h200": 2, "a100-80gb": 3, "cpu": 5}
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
REPORT_H200 = RESULTS / "gpu-report-nvidia-h200.json"
KERNEL_H100 = RESULTS / "kernel-nvidia-h100-80gb-hbm3.json"
SWAP_H100 = RESULTS / "swap-NVIDIA_H100_80GB_HBM3.json"
REPORT_H100 = RESULTS / "h100-4e07f94" / "gpu-report-nvidia-h100.json"

H100_PEAK_FLOPS = 989e12  # H100 SXM5 dense bf16 (spec sheet)
H100_MATMUL_SHARE = 0.81  # 798 TFLOP/s measured
H100_HBM_SPEC = 3.35e12
PCIE5_BPS = 64e9  # x16, one direction
A100_PEAK_FLOPS = 312e12  # A100 SXM 80GB dense bf16 (spec sheet)
A100_HBM_SPEC = 2.039e12
PCIE4_BPS = 32e9
MATMUL_HALF_TOKENS = 64.0
PM9A3_READ_BPS = 6.5e9  # Samsung PM9A3 U.2, sequential read (spec sheet)
PM9A3_WRITE_BPS = 3.5e9  # sequential write
# The host's work a step on the lent GPU machines (module docstring): the fit of the host
# time the real serving runs imply, each run's in its twin's `step_ms`
# (bench/results/h100-4e07f94/gpu-report-nvidia-h100-sim-h100-v3.json and
# bench/results/gpu-report-nvidia-h200-sim-h200-v2.json; tests/bench/test_sim.py refits it).
H100_STEP_HOST_S = 0.0  # per step: the fit's part, none (the forward has a fixed part)
H100_ROW_HOST_S = 0.083e-3  # per sampled row of the step


@dataclass(frozen=True)
class Copies:
    """How the tiers' copies cost: bytes / bandwidth; on a GPU a side stream overlaps them
    with the forward, on a CPU they run in the step."""

    swap_in_bps: float
    swap_out_bps: float
    swap_in_hidden: float  # share of a swap-in hidden behind the forward it runs beside
    synchronous: bool  # the CPU: every copy is on the step's critical path


@dataclass(frozen=True)
class Disk:
    """The drive behind a simulated disk tier: reads and writes at its sequential rates
    (one drive: `engine/sim/disk.py` puts reads first)."""

    read_bps: float
    write_bps: float
    source: str


NVME = Disk(PM9A3_READ_BPS, PM9A3_WRITE_BPS, "Samsung PM9A3 U.2 spec sheet (assumed drive)")


@dataclass(frozen=True)
class Device:
    """A simulated device for one model: what a step and a copy cost, and its memory."""

    name: str
    cost: StepCost
    copies: Copies
    memory_bytes: float
    sources: tuple[str, ...]
    disk: Disk | None = None  # the disk tier's drive (None: the device has no disk tier)
    # The eviction policy's Cost(l) where the real engine measures it on this device (the
    # `cpu` model: its profile); None: derived from `cost`, as a GPU's has no real profile.
    policy_cost: CostModel | None = None

    @property
    def label(self) -> str:
        return f"{self.name} cost model v{VERSIONS[self.name]}"


def _robust_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares y = a + b x, refitted without points off by more than 3 median
    absolute residuals (one noisy kernel timing must not set the launch cost)."""

    def fit(pts):
        n = len(pts)
        mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
        b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        return my - b * mx, b

    a, b = fit(points)
    res = [abs(y - a - b * x) for x, y in points]
    mad = statistics.median(res)
    kept = [p for p, r in zip(points, res, strict=True) if r <= 3 * mad]
    return fit(kept) if len(kept) >= 3 else (a, b)


def _h100_attention() -> tuple[float, float, float, float]:
    """(launch s, KV bytes/s, prefill FLOP/s, best decode bytes/s) of the measured kernel."""
    pts = json.loads(KERNEL_H100.read_text())["points"]
    triton = [p for p in pts if p["method"] == "triton"]
    decode = [(p["gbps"] * 1e9 * p["ms"] * 1e-3, p["ms"] * 1e-3) for p in triton
              if p["scenario"] == "decode"]  # fmt: skip
    launch, per_byte = _robust_line(decode)
    flops = max(p["tflops"] * 1e12 for p in triton if p["scenario"] != "decode")
    best = max(p["gbps"] * 1e9 for p in triton if p["scenario"] == "decode")
    return max(launch, 0.0), 1.0 / per_byte, flops, best


def h100_spec() -> GPUSpec:
    launch, attn_bps, attn_flops, hbm = _h100_attention()
    swap = json.loads(SWAP_H100.read_text())
    return GPUSpec(
        name="h100",
        matmul_flops=H100_PEAK_FLOPS * H100_MATMUL_SHARE,
        matmul_half_tokens=MATMUL_HALF_TOKENS,
        hbm_bps=hbm,
        attn_launch_s=launch,
        attn_bps=attn_bps,
        attn_flops=attn_flops,
        token_layer_s=0.0,  # set from the measured forward below
        step_host_s=H100_STEP_HOST_S,
        row_host_s=H100_ROW_HOST_S,
        swap_in_bps=swap["swap_in_GBps"] * 1e9,
        swap_out_bps=swap["swap_out_GBps"] * 1e9,
        swap_in_hidden=swap["swap_in_hidden_share"],
        memory_bytes=80e9,
        sources=(
            KERNEL_H100.name,
            SWAP_H100.name,
            str(REPORT_H100.relative_to(RESULTS)),
            REPORT_H200.name,
            "H100 SXM5 spec sheet",
        ),  # fmt: skip
    )


def _fit_token_cost(spec: GPUSpec, shape: Shape, tokens: int, measured_s: float) -> GPUSpec:
    """The per-token, per-layer cost of the unfused elementwise work: what a measured
    prefill forward of `tokens` took beyond the model's matmuls and attention."""
    bare = Roofline(spec, shape).forward_s([Work(tokens, 0, True)])
    extra = max(0.0, measured_s - bare) / (shape.layers * tokens)
    return replace(spec, token_layer_s=extra)


def _h100(measured_shape: Shape) -> GPUSpec:
    swap = json.loads(SWAP_H100.read_text())
    # The swap benchmark's forward: a 2048-token prefill of dummy:llama-2-13b-gqa10, bf16.
    return _fit_token_cost(h100_spec(), measured_shape, 2048, swap["forward_s"])


def a100_spec(h100: GPUSpec) -> GPUSpec:
    """The H100's achieved shares applied to the A100's spec sheet."""
    hbm_share = h100.hbm_bps / H100_HBM_SPEC
    link_share = h100.swap_in_bps / PCIE5_BPS
    slower = H100_HBM_SPEC / A100_HBM_SPEC  # elementwise work is bound by HBM
    return replace(
        h100,
        name="a100-80gb",
        matmul_flops=A100_PEAK_FLOPS * H100_MATMUL_SHARE,
        hbm_bps=A100_HBM_SPEC * hbm_share,
        attn_bps=h100.attn_bps * A100_HBM_SPEC / H100_HBM_SPEC,
        attn_flops=h100.attn_flops * A100_PEAK_FLOPS / H100_PEAK_FLOPS,
        token_layer_s=h100.token_layer_s * slower,
        swap_in_bps=PCIE4_BPS * link_share,
        swap_out_bps=PCIE4_BPS * h100.swap_out_bps / PCIE5_BPS,
        memory_bytes=80e9,
        sources=(*h100.sources, "A100 SXM 80GB spec sheet"),
    )


def h200_spec(h100: GPUSpec, shape: Shape) -> GPUSpec:
    """The H200's measured matmul rate, copy bandwidth and prefill forward; the rest the
    H100's (see the module's docstring)."""
    report = json.loads(REPORT_H200.read_text())
    prefill = next(p for p in report["mfu"]["prefill"] if p["prompt_tokens"] == 2048)
    spec = replace(
        h100,
        name="h200",
        matmul_flops=report["mfu"]["matmul_flops_per_s"],
        hbm_bps=report["decode"]["hbm"]["bytes_per_s"],
        token_layer_s=0.0,  # fitted below on the H200's own forward
        memory_bytes=141e9,
        sources=(*h100.sources, REPORT_H200.name),
    )
    # One 2048-token prompt per step (the report's max_batch_tokens): a forward each.
    return _fit_token_cost(spec, shape, 2048, prefill["seconds"] / prefill["requests"])


GPUS = ("h100", "h200", "a100-80gb")
DEVICES = (*GPUS, "cpu")


def gpu_device(name: str, shape: Shape) -> Device:
    """A simulated GPU running a model of `shape`."""
    measured = Shape.of(model_args("dummy:llama-2-13b-gqa10"), "bfloat16")
    spec = _h100(measured)
    if name == "a100-80gb":
        spec = a100_spec(spec)
    elif name == "h200":
        spec = h200_spec(spec, measured)
    elif name != "h100":
        raise ValueError(f"unknown simulated device {name!r}; known: {', '.join(DEVICES)}")
    copies = Copies(spec.swap_in_bps, spec.swap_out_bps, spec.swap_in_hidden, False)
    sources = (*spec.sources, NVME.source)
    return Device(spec.name, Roofline(spec, shape), copies, spec.memory_bytes, sources, NVME)


__all__ = ["Device", "Copies", "Disk", "Features", "gpu_device", "DEVICES", "GPUS", "VERSIONS"]
