"""What every family shares: `Family` (the layers the decoder builds, how a transformers
config becomes `ModelArgs` fields and back, the checkpoint's names), the config fields
and checkpoint layouts many families read and write alike, and `UnsupportedModel`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

# A model's shape: `engine.model.shapes.ModelArgs`. Not imported here, not even for type
# checking: shapes.py imports this package to find a shape's family, and engine/'s imports
# make no cycle, type hints included.
Shape = Any

# own tensor name -> the checkpoint tensors concatenated (dim 0) to make it, with their rows
WeightMap = dict[str, list[tuple[str, int]]]

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}
ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModel(ValueError):
    """A config or checkpoint the engine cannot run exactly; the message names what."""


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str  # the transformers class (the oracle's, and in `to_hf` configs)
    norm: str  # "rms" | "layer" | "gemma" (RMS, scaled by 1 + weight in float32)
    rope: bool  # rotary positions; else a learned position table
    gated_mlp: bool  # down(act(gate(x)) * up(x)); else fc2(act(fc1(x)))
    position_offset: int  # learned positions: table row of position 0 (OPT: 2)
    read_config: Callable[[dict], dict]  # transformers config -> ModelArgs fields
    write_config: Callable[[Shape], dict]  # ModelArgs -> transformers config
    names: Callable[[Shape], WeightMap]
    # Gemma: norms after attention and after the MLP too (before the residual add)
    sandwich: bool = False
    scaled_embed: bool = False  # Gemma: embeddings times sqrt(dim), rounded to their dtype
    # The reader places every layer's sliding window as transformers does, so the context may
    # run past it (else it stops at the window: see `ModelArgs.max_context`).
    exact_window: bool = False
    # The checkpoint as `names` expects it, read lazily (gpt-oss: experts transposed, gate/up
    # de-interleaved, MXFP4 dequantized); and back (`to_hf`). None: as it is.
    view: Callable[[Any], Any] | None = None
    unview: Callable[[dict], dict] | None = None


def read_rope(
    config: dict, allowed: tuple[str, ...] = ROPE_TYPES, default_theta: float = 10000.0
) -> tuple[float, dict | None]:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = config.get("rope_theta", rope.get("rope_theta", default_theta))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in allowed:
        raise UnsupportedModel(f"rope scaling {kind!r} is not supported (only {allowed})")
    return theta, (rope if kind != "default" else None)


def activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise UnsupportedModel(f"activation {name!r} is not supported (only {list(ACTIVATIONS)})")
    return name


def rotary_fields(family: str, config: dict, theta, scaling, norm_eps: float) -> dict:
    """The fields every rotary, RMS-normed family reads the same way."""
    heads = config["num_attention_heads"]
    return {
        "family": family,
        "vocab_size": config["vocab_size"],
        "dim": config["hidden_size"],
        "n_layers": config["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
        "intermediate_size": config["intermediate_size"],
        "norm_eps": config.get("rms_norm_eps", norm_eps),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position": config.get("max_position_embeddings", 4096),
        "tie_embeddings": config.get("tie_word_embeddings", False),
        "hidden_act": activation(config.get("hidden_act", "silu")),
    }


def rope_parameters(a: Shape) -> dict:
    """The (global) RoPE as transformers 5 writes it: its type, scaling and base."""
    if a.rope_scaling:
        return {**a.rope_scaling, "rope_theta": a.rope_theta}
    return {"rope_type": "default", "rope_theta": a.rope_theta}


def rms_decoder_config(a: Shape) -> dict:
    """The fields every RMS-normed decoder family writes alike."""
    return {
        "model_type": a.family,
        "architectures": [a.spec.architecture],
        "vocab_size": a.vocab_size,
        "hidden_size": a.dim,
        "num_hidden_layers": a.n_layers,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads,
        "head_dim": a.head_dim,
        "intermediate_size": a.intermediate_size,
        "rms_norm_eps": a.norm_eps,
        "max_position_embeddings": a.max_position,
        "tie_word_embeddings": a.tie_embeddings,
    }


SLIDING, FULL = "sliding_attention", "full_attention"


def layer_windows(window: int | None, types: list[str] | None, n: int) -> dict:
    """`sliding_window` and `full_layers` from transformers' `layer_types` (`None`: every
    layer slides over `window`, or none where `window` is None). A sliding layer without a
    window is refused: transformers' sliding mask raises on it."""
    if types is None:
        types = [FULL if window is None else SLIDING] * n
    if len(types) < n:
        raise UnsupportedModel(f"layer_types has {len(types)} entries for {n} layers")
    unknown = set(types[:n]) - {SLIDING, FULL}
    if unknown:
        raise UnsupportedModel(f"layer_types {sorted(unknown)} are not supported")
    full = tuple(i for i in range(n) if types[i] == FULL)
    if len(full) == n:
        return {"sliding_window": None, "full_layers": ()}
    if window is None:
        raise UnsupportedModel(
            "layer_types has sliding layers but no sliding_window (or use_sliding_window off)"
        )
    return {"sliding_window": window, "full_layers": full}


def layer_types(a: Shape) -> list[str]:
    """transformers' `layer_types` of a shape: each layer sliding or full."""
    return [FULL if a.window(i) is None else SLIDING for i in range(a.n_layers)]


def add_linear(m: WeightMap, own: str, parts: list[tuple[str, int]], bias: bool) -> None:
    m[own + ".weight"] = [(p + ".weight", rows) for p, rows in parts]
    if bias:
        m[own + ".bias"] = [(p + ".bias", rows) for p, rows in parts]
