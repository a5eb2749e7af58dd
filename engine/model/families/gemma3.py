"""gemma3_text (Gemma 3's text model): sliding and global layers with RoPE bases of their
own, q/k norms, sandwich norms, a scaled embedding."""

from __future__ import annotations

from engine.model.families.base import (
    FULL,
    SLIDING,
    Shape,
    UnsupportedModel,
    WeightMap,
    activation,
    layer_types,
    layer_windows,
    rms_decoder_config,
    rope_parameters,
    rotary_fields,
)
from engine.model.families.llama import llama_like, llama_names


def _read_gemma3(config: dict) -> dict:
    """Gemma 3's text model: sliding layers with a RoPE base of their own, global layers with
    the model's (maybe linearly scaled), q/k norms, sandwich norms, a scaled embedding."""
    for key in ("attn_logit_softcapping",):
        if config.get(key) is not None:
            raise UnsupportedModel(f"{key} is not supported (Gemma 3 leaves it unset)")
    if config.get("use_bidirectional_attention"):
        raise UnsupportedModel("use_bidirectional_attention is not supported (causal only)")
    theta, scaling, local_theta = _gemma3_rope(config)
    bias = bool(config.get("attention_bias", False))
    fields = rotary_fields("gemma3_text", config, theta, scaling, 1e-6)
    return fields | {
        "hidden_act": activation(config.get("hidden_activation") or "gelu_pytorch_tanh"),
        "tie_embeddings": config.get("tie_word_embeddings", True),
        "qkv_bias": bias,
        "o_bias": bias,
        "qk_norm": True,
        **layer_windows(
            config.get("sliding_window"), _gemma3_layer_types(config), fields["n_layers"]
        ),
        "rope_local_theta": local_theta,
        "query_pre_attn_scalar": config.get("query_pre_attn_scalar", 256),
        "final_softcap": config.get("final_logit_softcapping"),
    }


def _gemma3_rope(config: dict) -> tuple[float, dict | None, float]:
    """(global theta, global scaling, local theta), from either key layout: transformers 5's
    `rope_parameters` per layer type, or the older `rope_theta`, `rope_scaling` and
    `rope_local_base_freq`."""
    params = config.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
    else:
        full, local = params or config.get("rope_scaling") or {}, {}
    theta = full.get("rope_theta", config.get("rope_theta", 1e6))
    local_theta = local.get("rope_theta", config.get("rope_local_base_freq", 1e4))
    kind = full.get("rope_type", full.get("type", "default"))
    if kind not in ("default", "linear"):
        raise UnsupportedModel(f"rope scaling {kind!r} is not supported (only default, linear)")
    local_kind = local.get("rope_type", local.get("type", "default"))
    if local_kind != "default":
        raise UnsupportedModel(f"rope scaling {local_kind!r} on sliding layers is not supported")
    scaling = {"rope_type": "linear", "factor": full["factor"]} if kind == "linear" else None
    return theta, scaling, local_theta


def _gemma3_layer_types(config: dict) -> list[str]:
    """Each layer sliding or full: `layer_types`, or in older configs every
    `sliding_window_pattern`-th layer full (transformers' default: 6)."""
    types = config.get("layer_types")
    if types is None:
        pattern = config.get("sliding_window_pattern", 6)
        n = config["num_hidden_layers"]
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    return types


def _write_gemma3(a: Shape) -> dict:
    if a.qkv_bias != a.o_bias or a.mlp_bias:
        raise UnsupportedModel(
            "gemma3_text has one attention_bias for q/k/v and o, none in the MLP"
        )
    local = {"rope_type": "default", "rope_theta": a.rope_local_theta}
    return rms_decoder_config(a) | {
        "rope_parameters": {"full_attention": rope_parameters(a), "sliding_attention": local},
        "hidden_activation": a.hidden_act,
        "attention_bias": a.qkv_bias,
        "sliding_window": a.sliding_window,
        "layer_types": layer_types(a),
        "query_pre_attn_scalar": a.query_pre_attn_scalar,
        "final_logit_softcapping": a.final_softcap,
    }


def _gemma3_names(a: Shape) -> WeightMap:
    """Llama's names, with Gemma's four norms a layer: before and after attention, before
    and after the MLP."""
    m = llama_names(a)
    for i in range(a.n_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        m[o + "post_attn_norm.weight"] = [(p + "post_attention_layernorm.weight", a.dim)]
        m[o + "mlp_norm.weight"] = [(p + "pre_feedforward_layernorm.weight", a.dim)]
        m[o + "post_mlp_norm.weight"] = [(p + "post_feedforward_layernorm.weight", a.dim)]
    return m


GEMMA3 = llama_like(
    "gemma3_text",
    "Gemma3ForCausalLM",
    norm="gemma",
    read_config=_read_gemma3,
    write_config=_write_gemma3,
    names=_gemma3_names,
    sandwich=True,
    scaled_embed=True,
    exact_window=True,
)
