"""phi3 (Phi-3, Phi-4-mini): Llama's math with fused q/k/v and gate/up checkpoints, partial
rotary dims and LongRoPE."""

from __future__ import annotations

from functools import partial

from engine.model.families.base import (
    Shape,
    UnsupportedModel,
    layer_windows,
    read_rope,
    rms_decoder_config,
    rotary_fields,
)
from engine.model.families.llama import llama_like, llama_names, write_windows


def _read_phi3(config: dict) -> dict:
    """Phi-3 and Phi-4-mini: Llama's math with fused checkpoints, partial rotary dims
    (Phi-4-mini: 3/4 of each head) and LongRoPE (read as its short factors, exact up to the
    original context length, where the engine stops: see `ModelArgs.max_context`)."""
    theta, scaling = read_rope(config, allowed=("default", "longrope", "su", "yarn"))
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    partial_rotary = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if scaling is not None:  # "su" and "yarn" are what older Phi-3 configs call LongRoPE
        old_len = scaling.get(
            "original_max_position_embeddings", config.get("original_max_position_embeddings")
        )
        if old_len is None or "short_factor" not in scaling:
            raise UnsupportedModel(
                "longrope needs short_factor and original_max_position_embeddings"
            )
        scaling = {
            "rope_type": "longrope",
            "short_factor": list(scaling["short_factor"]),
            "long_factor": scaling.get("long_factor"),  # past the original length: not used
            "original_max_position_embeddings": old_len,
            "factor": scaling.get("factor"),
            "attention_factor": scaling.get("attention_factor"),
        }
    fields = rotary_fields("phi3", config, theta, scaling, 1e-5)
    # transformers' Phi3 masks every layer with `sliding_window` (Phi-3-mini-4k: 2047)
    windows = layer_windows(config.get("sliding_window"), None, fields["n_layers"])
    return fields | windows | {"partial_rotary_factor": float(partial_rotary)}


def _write_phi3(a: Shape) -> dict:
    if a.qkv_bias or a.o_bias or a.mlp_bias:
        raise UnsupportedModel("phi3 has no biases")
    rope = {"rope_type": "default", "rope_theta": a.rope_theta}
    if a.rope_scaling:
        rope = {k: v for k, v in a.rope_scaling.items() if v is not None}
        rope["rope_theta"] = a.rope_theta
    rope["partial_rotary_factor"] = a.partial_rotary_factor
    config = rms_decoder_config(a) | {
        "rope_theta": a.rope_theta,
        "rope_parameters": rope,
        "partial_rotary_factor": a.partial_rotary_factor,
        "hidden_act": a.hidden_act,
    }
    config |= write_windows(a)
    if a.rope_scaling:
        old_len = a.rope_scaling["original_max_position_embeddings"]
        config["original_max_position_embeddings"] = old_len
    if a.head_dim == a.dim // a.n_heads:  # phi3 configs name head_dim only where it differs
        del config["head_dim"]
    return config


PHI3 = llama_like(
    "phi3",
    "Phi3ForCausalLM",
    read_config=_read_phi3,
    write_config=_write_phi3,
    names=partial(llama_names, fused=True),
    exact_window=True,
)
