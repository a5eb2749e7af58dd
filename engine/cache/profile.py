"""Profile the recompute cost of one chunk per context length, once per model and device."""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path

import torch

import kernels
from engine.cache.policy import CostModel
from engine.model.decoder import Decoder

log = logging.getLogger(__name__)


def timed(fn, device: torch.device, repeats: int = 3) -> float:
    """Median seconds of `fn` after a warm-up: CUDA events on the GPU, wall time elsewhere."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


@torch.inference_mode()
def profile(
    model: Decoder, chunk_size: int, max_context: int, device, dtype, backend=None
) -> CostModel:
    """Attention of a chunk's queries over contexts of powers of two, plus the rest of a layer
    (projections and MLP of `chunk_size` tokens), times the number of layers."""
    a = model.args
    device = torch.device(device)
    contexts = []
    ctx = chunk_size
    while ctx <= max_context:
        contexts.append(ctx)
        ctx *= 2
    n_blocks = contexts[-1] // chunk_size + 1
    k = torch.randn(n_blocks, chunk_size, a.n_kv_heads, a.head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    q = torch.randn(chunk_size, a.n_heads, a.head_dim, device=device, dtype=dtype)
    attn = []
    for ctx in contexts:
        meta = kernels.AttentionMetadata.build(
            [chunk_size], [ctx - chunk_size], [list(range(ctx // chunk_size))], device
        )
        attn.append(
            a.n_layers
            * timed(
                lambda m=meta: kernels.paged_attention(q, k, v, m, a.head_dim**-0.5, backend),
                device,
            )
        )
    layer = model.layers[0]
    x = torch.randn(chunk_size, a.dim, device=device, dtype=dtype)

    def rest() -> None:
        q, _, _ = layer.qkv(layer.attn_norm(x), None)
        h = layer.wo(q.reshape(chunk_size, a.n_heads * a.head_dim))
        layer.mlp(layer.mlp_norm(h))

    other = a.n_layers * timed(rest, device)
    # Keep it monotone: noise must not make a longer context look cheaper.
    for i in range(1, len(attn)):
        attn[i] = max(attn[i], attn[i - 1])
    return CostModel(contexts, attn, other)


def load_or_profile(
    model: Decoder,
    name: str,
    chunk_size: int,
    max_context: int,
    device,
    dtype,
    cache: Path,
    backend=None,
) -> CostModel:
    dev = torch.device(device)
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    key = f"{name}-{dev_name}-{str(dtype).removeprefix('torch.')}-{chunk_size}-{max_context}"
    path = (
        cache / "profiles" / (key.replace("/", "_").replace(":", "_").replace(" ", "_") + ".json")
    )
    if path.exists():
        try:
            return CostModel.from_dict(json.loads(path.read_text()))
        except (ValueError, KeyError):
            log.warning("ignoring unreadable cost profile %s", path)
    t = time.perf_counter()
    cost = profile(model, chunk_size, max_context, device, dtype, backend)
    log.info("profiled chunk recompute cost in %.1fs", time.perf_counter() - t)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cost.to_dict()))
    tmp.replace(path)
    return cost
