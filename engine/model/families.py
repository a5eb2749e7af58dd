"""Model families: how each transformers `model_type` maps onto the engine's decoder.

One `Family` per supported type says which layers the decoder builds (norm, positions, MLP),
how a transformers config becomes `ModelArgs` fields and back, and which checkpoint tensors
make each of the decoder's own (q/k/v and gate/up are fused, concatenated on dim 0).
Loading is strict both ways: a tensor the model needs that the checkpoint lacks, or one the
checkpoint has that the model would not use, refuses the checkpoint by name. No weight is
dropped silently; only buffers that are not weights (`_NOT_WEIGHTS`) are skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engine.model.shapes import ModelArgs

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
# Buffers some checkpoints carry that the model recomputes: not weights, safe to skip.
_NOT_WEIGHTS = (".rotary_emb.inv_freq",)


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
    write_config: Callable[[ModelArgs], dict]  # ModelArgs -> transformers config
    names: Callable[[ModelArgs], WeightMap]
    # Gemma: norms after attention and after the MLP too (before the residual add)
    sandwich: bool = False
    scaled_embed: bool = False  # Gemma: embeddings times sqrt(dim), rounded to their dtype
    # The reader maps every layer's sliding window as transformers does, so the context may
    # run past it (else it stops at the window: see `ModelArgs.max_context`).
    exact_window: bool = False


# ---- configs ---------------------------------------------------------------------------------


def _rope(
    config: dict, allowed: tuple[str, ...] = ROPE_TYPES, default_theta: float = 10000.0
) -> tuple[float, dict | None]:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = config.get("rope_theta", rope.get("rope_theta", default_theta))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in allowed:
        raise UnsupportedModel(f"rope scaling {kind!r} is not supported (only {allowed})")
    return theta, (rope if kind != "default" else None)


def _activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise UnsupportedModel(f"activation {name!r} is not supported (only {list(ACTIVATIONS)})")
    return name


def _rotary_fields(family: str, config: dict, theta, scaling, norm_eps: float) -> dict:
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
        "hidden_act": _activation(config.get("hidden_act", "silu")),
    }


def _read_llama_like(model_type: str, config: dict) -> dict:
    theta, scaling = _rope(config, default_theta=2e6 if model_type == "smollm3" else 10000.0)
    fields = _rotary_fields(model_type, config, theta, scaling, 1e-6)
    if model_type == "llama":
        bias = bool(config.get("attention_bias", False))
        fields |= {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(config.get("mlp_bias"))}
    elif model_type == "qwen2":  # q/k/v always carry biases; o and the MLP never do
        fields["qkv_bias"] = True
        if config.get("use_sliding_window"):
            fields["sliding_window"] = config.get("sliding_window")
    elif model_type == "mistral":
        fields["sliding_window"] = config.get("sliding_window")
    elif model_type in ("qwen3", "qwen3_moe"):  # q/k norms; one attention_bias for q/k/v and o
        bias = bool(config.get("attention_bias", False))
        fields |= {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}
        if config.get("use_sliding_window"):
            fields["sliding_window"] = config.get("sliding_window")
    elif model_type == "smollm3":
        bias = bool(config.get("attention_bias", False))
        fields |= {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(config.get("mlp_bias"))}
        fields["no_rope_layers"] = _smollm3_no_rope(config)
        slides = "sliding_attention" in (config.get("layer_types") or [])
        if config.get("use_sliding_window") and slides:  # its layers without RoPE slide
            fields["sliding_window"] = config.get("sliding_window")
    return fields


def _smollm3_no_rope(config: dict) -> tuple[int, ...]:
    """The layers without RoPE. transformers' rule: `no_rope_layers[i]` is 1 where layer i
    rotates (a name that reads backwards); absent, every `no_rope_layer_interval`-th layer
    (the 4th, 8th, ...) goes without."""
    n = config["num_hidden_layers"]
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = config.get("no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if len(flags) < n:
        raise UnsupportedModel(f"no_rope_layers has {len(flags)} entries for {n} layers")
    return tuple(i for i in range(n) if not flags[i])


def _rope_parameters(a: ModelArgs) -> dict:
    """The (global) RoPE as transformers 5 writes it: its type, scaling and base."""
    if a.rope_scaling:
        return {**a.rope_scaling, "rope_theta": a.rope_theta}
    return {"rope_type": "default", "rope_theta": a.rope_theta}


def _rms_decoder_config(a: ModelArgs) -> dict:
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


def _write_llama_like(a: ModelArgs) -> dict:
    config = _rms_decoder_config(a) | {
        "rope_theta": a.rope_theta,
        "rope_parameters": _rope_parameters(a),
        "hidden_act": a.hidden_act,
    }
    if a.family == "llama":
        if a.qkv_bias != a.o_bias:
            raise UnsupportedModel("a llama config has one attention_bias for q/k/v and o")
        config |= {"attention_bias": a.qkv_bias, "mlp_bias": a.mlp_bias}
    elif a.family == "qwen2":
        config |= {"use_sliding_window": a.sliding_window is not None}
        config |= {"sliding_window": a.sliding_window}
    elif a.family == "mistral":
        config["sliding_window"] = a.sliding_window
    elif a.family in ("qwen3", "smollm3", "qwen3_moe"):
        if a.qkv_bias != a.o_bias:
            raise UnsupportedModel(f"a {a.family} config has one attention_bias for q/k/v and o")
        config |= {"attention_bias": a.qkv_bias, "use_sliding_window": a.sliding_window is not None}
        config["sliding_window"] = a.sliding_window
        if a.family == "smollm3":
            config["mlp_bias"] = a.mlp_bias
            config["no_rope_layers"] = [int(i not in a.no_rope_layers) for i in range(a.n_layers)]
    return config


def _read_opt(config: dict) -> dict:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    proj = config.get("word_embed_proj_dim") or hidden
    if proj != hidden:
        raise UnsupportedModel(
            f"OPT with word_embed_proj_dim {proj} != hidden_size {hidden} "
            "(projected embeddings, as in opt-350m) is not supported"
        )
    if not config.get("do_layer_norm_before", True):
        raise UnsupportedModel(
            "OPT with do_layer_norm_before=false (post-norm layers, as in opt-350m) is not supported"
        )
    if config.get("_remove_final_layer_norm"):
        raise UnsupportedModel("OPT without a final layer norm is not supported")
    if not config.get("layer_norm_elementwise_affine", True):
        raise UnsupportedModel("OPT with layer_norm_elementwise_affine=false is not supported")
    if hidden % heads:
        raise UnsupportedModel(f"hidden_size {hidden} does not divide into {heads} heads")
    bias = bool(config.get("enable_bias", True))
    return {
        "family": "opt",
        "vocab_size": config["vocab_size"],
        "dim": hidden,
        "n_layers": config["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": heads,
        "head_dim": hidden // heads,
        "intermediate_size": config["ffn_dim"],
        "norm_eps": 1e-5,  # nn.LayerNorm's default, which OPT uses
        "max_position": config.get("max_position_embeddings", 2048),
        "tie_embeddings": config.get("tie_word_embeddings", True),
        "qkv_bias": bias,
        "o_bias": bias,
        "mlp_bias": bias,
        "hidden_act": _activation(config.get("activation_function", "relu")),
    }


def _write_opt(a: ModelArgs) -> dict:
    if not a.qkv_bias == a.o_bias == a.mlp_bias:
        raise UnsupportedModel("an OPT config has one enable_bias for every linear")
    return {
        "model_type": "opt",
        "architectures": [a.spec.architecture],
        "vocab_size": a.vocab_size,
        "hidden_size": a.dim,
        "word_embed_proj_dim": a.dim,
        "num_hidden_layers": a.n_layers,
        "num_attention_heads": a.n_heads,
        "ffn_dim": a.intermediate_size,
        "max_position_embeddings": a.max_position,
        "do_layer_norm_before": True,
        "enable_bias": a.qkv_bias,
        "activation_function": a.hidden_act,
        "tie_word_embeddings": a.tie_embeddings,
    }


def _read_phi3(config: dict) -> dict:
    """Phi-3 and Phi-4-mini: Llama's math with fused checkpoints, partial rotary dims
    (Phi-4-mini: 3/4 of each head) and LongRoPE (read as its short factors, exact up to the
    original context length, where the engine stops: see `ModelArgs.max_context`)."""
    theta, scaling = _rope(config, allowed=("default", "longrope", "su", "yarn"))
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
    return _rotary_fields("phi3", config, theta, scaling, 1e-5) | {
        "partial_rotary_factor": float(partial_rotary),
        "sliding_window": config.get("sliding_window"),
    }


def _write_phi3(a: ModelArgs) -> dict:
    if a.qkv_bias or a.o_bias or a.mlp_bias:
        raise UnsupportedModel("phi3 has no biases")
    rope = {"rope_type": "default", "rope_theta": a.rope_theta}
    if a.rope_scaling:
        rope = {k: v for k, v in a.rope_scaling.items() if v is not None}
        rope["rope_theta"] = a.rope_theta
    rope["partial_rotary_factor"] = a.partial_rotary_factor
    config = _rms_decoder_config(a) | {
        "rope_theta": a.rope_theta,
        "rope_parameters": rope,
        "partial_rotary_factor": a.partial_rotary_factor,
        "hidden_act": a.hidden_act,
        "sliding_window": a.sliding_window,
    }
    if a.rope_scaling:
        old_len = a.rope_scaling["original_max_position_embeddings"]
        config["original_max_position_embeddings"] = old_len
    if a.head_dim == a.dim // a.n_heads:  # phi3 configs name head_dim only where it differs
        del config["head_dim"]
    return config


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
    fields = _rotary_fields("gemma3_text", config, theta, scaling, 1e-6)
    return fields | {
        "hidden_act": _activation(config.get("hidden_activation") or "gelu_pytorch_tanh"),
        "tie_embeddings": config.get("tie_word_embeddings", True),
        "qkv_bias": bias,
        "o_bias": bias,
        "qk_norm": True,
        "sliding_window": config.get("sliding_window"),
        "full_layers": _gemma3_full_layers(config),
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


def _gemma3_full_layers(config: dict) -> tuple[int, ...]:
    """The layers that attend to every key: `layer_types`, or in older configs every
    `sliding_window_pattern`-th layer (transformers' default: 6)."""
    n = config["num_hidden_layers"]
    types = config.get("layer_types")
    if types is None:
        pattern = config.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if len(types) < n:
        raise UnsupportedModel(f"layer_types has {len(types)} entries for {n} layers")
    unknown = set(types[:n]) - {"sliding_attention", "full_attention"}
    if unknown:
        raise UnsupportedModel(f"layer_types {sorted(unknown)} are not supported")
    return tuple(i for i in range(n) if types[i] == "full_attention")


def _write_gemma3(a: ModelArgs) -> dict:
    if a.qkv_bias != a.o_bias or a.mlp_bias:
        raise UnsupportedModel(
            "gemma3_text has one attention_bias for q/k/v and o, none in the MLP"
        )
    local = {"rope_type": "default", "rope_theta": a.rope_local_theta}
    return _rms_decoder_config(a) | {
        "rope_parameters": {"full_attention": _rope_parameters(a), "sliding_attention": local},
        "hidden_activation": a.hidden_act,
        "attention_bias": a.qkv_bias,
        "sliding_window": a.sliding_window,
        "layer_types": [
            "full_attention" if i in a.full_layers else "sliding_attention"
            for i in range(a.n_layers)
        ],
        "query_pre_attn_scalar": a.query_pre_attn_scalar,
        "final_logit_softcapping": a.final_softcap,
    }


# Keys of MoE configs that change the math, not implemented here, with the value that means
# "not used": a config with another value is refused by the key's name. (Keys for training
# only, as output_router_logits and router_aux_loss_coef, change nothing at inference.)
_MOE_UNUSED = {
    "shared_expert_intermediate_size": 0,  # Qwen2-MoE's shared expert
    "n_shared_experts": 0,
    "num_shared_experts": 0,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "n_group": 1,  # grouped top-k routing (DeepSeek-V3)
    "topk_group": 1,
    "first_k_dense_replace": 0,
}


def _read_qwen3_moe(config: dict) -> dict:
    """Qwen3's attention with routed experts: `num_experts_per_tok` of `num_experts` a token,
    dense MLPs in `mlp_only_layers` and off the `decoder_sparse_step` grid, as transformers
    builds them."""
    for key, unused in _MOE_UNUSED.items():
        if config.get(key) not in (None, unused):
            raise UnsupportedModel(f"{key}={config[key]!r} is not supported (only {unused!r})")
    fields = _read_llama_like("qwen3_moe", config)
    experts = config.get("num_experts", config.get("num_local_experts", 0))  # its alias
    top_k, step = config["num_experts_per_tok"], config.get("decoder_sparse_step", 1)
    if not 0 < top_k <= experts:
        raise UnsupportedModel(f"num_experts_per_tok {top_k} of {experts} experts")
    only = set(config.get("mlp_only_layers") or [])
    dense = [i for i in range(fields["n_layers"]) if i in only or (i + 1) % step]
    return fields | {
        "n_experts": experts,
        "top_k": top_k,
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        "moe_intermediate_size": config["moe_intermediate_size"],
        "dense_layers": tuple(dense),
    }


def _write_qwen3_moe(a: ModelArgs) -> dict:
    return _write_llama_like(a) | {
        "num_experts": a.n_experts,
        "num_experts_per_tok": a.top_k,
        "norm_topk_prob": a.norm_topk_prob,
        "moe_intermediate_size": a.moe_intermediate_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(a.dense_layers),
    }


# ---- weight names ----------------------------------------------------------------------------


def _linear(m: WeightMap, own: str, parts: list[tuple[str, int]], bias: bool) -> None:
    m[own + ".weight"] = [(p + ".weight", rows) for p, rows in parts]
    if bias:
        m[own + ".bias"] = [(p + ".bias", rows) for p, rows in parts]


def _llama_names(a: ModelArgs, fused: bool = False) -> WeightMap:
    """Llama's layout; `fused`: q/k/v and gate/up stored as one tensor each, in the decoder's
    own order (Phi-3)."""
    q, kv, ffn = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.intermediate_size
    m: WeightMap = {"embed.weight": [("model.embed_tokens.weight", a.vocab_size)]}
    for i in range(a.n_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        attn = p + "self_attn."
        if fused:
            qkv = [(attn + "qkv_proj", q + 2 * kv)]
            gate_up = [(p + "mlp.gate_up_proj", 2 * ffn)]
        else:
            qkv = [(attn + "q_proj", q), (attn + "k_proj", kv), (attn + "v_proj", kv)]
            gate_up = [(p + "mlp.gate_proj", ffn), (p + "mlp.up_proj", ffn)]
        _linear(m, o + "wqkv", qkv, a.qkv_bias)
        _linear(m, o + "wo", [(attn + "o_proj", a.dim)], a.o_bias)
        _linear(m, o + "w13", gate_up, a.mlp_bias)
        _linear(m, o + "w2", [(p + "mlp.down_proj", a.dim)], a.mlp_bias)
        m[o + "attn_norm.weight"] = [(p + "input_layernorm.weight", a.dim)]
        m[o + "mlp_norm.weight"] = [(p + "post_attention_layernorm.weight", a.dim)]
        if a.qk_norm:
            m[o + "q_norm.weight"] = [(attn + "q_norm.weight", a.head_dim)]
            m[o + "k_norm.weight"] = [(attn + "k_norm.weight", a.head_dim)]
    m["norm.weight"] = [("model.norm.weight", a.dim)]
    if not a.tie_embeddings:
        m["lm_head.weight"] = [("lm_head.weight", a.vocab_size)]
    return m


def _gemma3_names(a: ModelArgs) -> WeightMap:
    """Llama's names, with Gemma's four norms a layer: before and after attention, before
    and after the MLP."""
    m = _llama_names(a)
    for i in range(a.n_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        m[o + "post_attn_norm.weight"] = [(p + "post_attention_layernorm.weight", a.dim)]
        m[o + "mlp_norm.weight"] = [(p + "pre_feedforward_layernorm.weight", a.dim)]
        m[o + "post_mlp_norm.weight"] = [(p + "post_feedforward_layernorm.weight", a.dim)]
    return m


def _moe_names(a: ModelArgs) -> WeightMap:
    """Llama's names with experts in place of the MLP of MoE layers: the router `mlp.gate`
    and each expert's gate/up/down (as the hub's checkpoints and transformers' saves name
    them). Own tensors hold the experts stacked: `w13` expert by expert [gate | up] rows,
    `w2` expert by expert."""
    m = _llama_names(a)
    for i in range(a.n_layers):
        if not a.is_moe_layer(i):
            continue
        p, o = f"model.layers.{i}.mlp.", f"layers.{i}."
        del m[o + "w13.weight"], m[o + "w2.weight"]
        m[o + "moe.router.weight"] = [(p + "gate.weight", a.n_experts)]
        each = [f"{p}experts.{e}." for e in range(a.n_experts)]
        ffn = a.moe_intermediate_size
        m[o + "moe.w13"] = [
            (x + w + ".weight", ffn) for x in each for w in ("gate_proj", "up_proj")
        ]
        m[o + "moe.w2"] = [(x + "down_proj.weight", a.dim) for x in each]
    return m


def _fused_experts(wmap: WeightMap, names: Collection[str]) -> WeightMap:
    """Where a checkpoint holds a layer's experts fused, as transformers 5 keeps them in
    memory (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]: the same rows),
    read those instead of the experts one by one."""
    out = dict(wmap)
    for own, parts in wmap.items():
        if own.endswith((".moe.w13", ".moe.w2")) and parts[0][0] not in names:
            base = parts[0][0].split("experts.")[0] + "experts."
            fused = base + ("gate_up_proj" if own.endswith("w13") else "down_proj")
            if fused in names:
                out[own] = [(fused, len(parts) // (2 if own.endswith("w13") else 1))]
    return out


def _opt_names(a: ModelArgs) -> WeightMap:
    d, rows = "model.decoder.", a.max_position + a.spec.position_offset
    m: WeightMap = {
        "embed.weight": [(d + "embed_tokens.weight", a.vocab_size)],
        "pos_embed.weight": [(d + "embed_positions.weight", rows)],
    }
    for i in range(a.n_layers):
        p, o = f"{d}layers.{i}.", f"layers.{i}."
        attn = p + "self_attn."
        qkv = [(attn + "q_proj", a.dim), (attn + "k_proj", a.dim), (attn + "v_proj", a.dim)]
        _linear(m, o + "wqkv", qkv, a.qkv_bias)
        _linear(m, o + "wo", [(attn + "out_proj", a.dim)], a.o_bias)
        _linear(m, o + "w1", [(p + "fc1", a.intermediate_size)], a.mlp_bias)
        _linear(m, o + "w2", [(p + "fc2", a.dim)], a.mlp_bias)
        _linear(m, o + "attn_norm", [(p + "self_attn_layer_norm", a.dim)], True)
        _linear(m, o + "mlp_norm", [(p + "final_layer_norm", a.dim)], True)
    _linear(m, "norm", [(d + "final_layer_norm", a.dim)], True)
    if not a.tie_embeddings:
        m["lm_head.weight"] = [("lm_head.weight", a.vocab_size)]
    return m


def _llama_like(model_type: str, architecture: str, **kw) -> Family:
    fields = {
        "norm": "rms",
        "rope": True,
        "gated_mlp": True,
        "position_offset": 0,
        "read_config": partial(_read_llama_like, model_type),
        "write_config": _write_llama_like,
        "names": _llama_names,
    }
    return Family(model_type, architecture, **fields | kw)


FAMILIES: dict[str, Family] = {
    "llama": _llama_like("llama", "LlamaForCausalLM"),
    "qwen2": _llama_like("qwen2", "Qwen2ForCausalLM"),
    "mistral": _llama_like("mistral", "MistralForCausalLM", exact_window=True),
    "qwen3": _llama_like("qwen3", "Qwen3ForCausalLM"),
    "smollm3": _llama_like("smollm3", "SmolLM3ForCausalLM"),
    "phi3": _llama_like(
        "phi3",
        "Phi3ForCausalLM",
        read_config=_read_phi3,
        write_config=_write_phi3,
        names=partial(_llama_names, fused=True),
    ),
    "gemma3_text": _llama_like(
        "gemma3_text",
        "Gemma3ForCausalLM",
        norm="gemma",
        read_config=_read_gemma3,
        write_config=_write_gemma3,
        names=_gemma3_names,
        sandwich=True,
        scaled_embed=True,
        exact_window=True,
    ),
    "opt": Family(
        "opt",
        "OPTForCausalLM",
        norm="layer",
        rope=False,
        gated_mlp=False,
        position_offset=2,  # OPT's learned table keeps rows 0 and 1 for padding
        read_config=_read_opt,
        write_config=_write_opt,
        names=_opt_names,
    ),
    "qwen3_moe": _llama_like(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        read_config=_read_qwen3_moe,
        write_config=_write_qwen3_moe,
        names=_moe_names,
    ),
}


def family_of(config: dict) -> Family:
    kind = config.get("model_type")
    if kind not in FAMILIES:
        raise UnsupportedModel(
            f"model_type {kind!r} is not supported; supported: {', '.join(FAMILIES)}"
        )
    return FAMILIES[kind]


# ---- checkpoints -----------------------------------------------------------------------------


def _shown(names: list[str], most: int = 8) -> str:
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def to_own(args: ModelArgs, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The decoder's own tensors from a checkpoint in transformers' naming; refuses a
    checkpoint with missing tensors or with tensors the model would not use."""
    return dict(iter_own(args, state))


def iter_own(
    args: ModelArgs, state: Mapping[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`to_own` one tensor at a time: with a lazy `state` (tensors read when looked up), a
    caller that keeps only a slice of each never holds the whole checkpoint. The names are
    checked before the first tensor is read."""
    if not any(k.startswith("model.") for k in state):  # saved from the base model (OPTModel)
        base = state
        state = _Renamed({(k if k == "lm_head.weight" else "model." + k): k for k in base}, base)
    wmap = _fused_experts(args.spec.names(args), state.keys())
    wanted = {name for parts in wmap.values() for name, _ in parts}
    missing = sorted(wanted - state.keys())
    unused = sorted(k for k in state.keys() - wanted if not k.endswith(_NOT_WEIGHTS))
    embed = wmap["embed.weight"][0][0]
    if args.tie_embeddings and "lm_head.weight" in unused and embed in state:
        if not torch.equal(state["lm_head.weight"], state[embed]):
            raise UnsupportedModel(
                "the config ties lm_head to the embeddings but the checkpoint's lm_head.weight differs"
            )
        unused.remove("lm_head.weight")  # the tied copy: the same values
    if missing:
        raise UnsupportedModel(f"{args.family} checkpoint lacks tensors: {_shown(missing)}")
    if unused:
        raise UnsupportedModel(
            f"{args.family} checkpoint has tensors this model does not use (refused rather than "
            f"dropped): {_shown(unused)}"
        )
    for name, parts in wmap.items():
        tensors = [state[hf] for hf, _ in parts]
        for (hf, rows), t in zip(parts, tensors, strict=True):
            if t.shape[0] != rows:
                raise UnsupportedModel(
                    f"{hf} has shape {tuple(t.shape)}, the config implies {rows} rows"
                )
        tensors = [t.flatten(0, 1) if t.dim() == 3 else t for t in tensors]  # fused experts
        yield name, tensors[0] if len(tensors) == 1 else torch.cat(tensors)


class _Renamed(Mapping):
    """A checkpoint seen under other names (new name -> old name), read through."""

    def __init__(self, names: dict[str, str], base: Mapping[str, torch.Tensor]) -> None:
        self.names, self.base = names, base

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.base[self.names[key]]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def to_hf(args: ModelArgs, own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `to_own`: the decoder's tensors in transformers' naming, unfused."""
    out = {}
    for name, parts in args.spec.names(args).items():
        pieces = own[name].split([rows for _, rows in parts])
        out.update((hf, t.contiguous()) for (hf, _), t in zip(parts, pieces, strict=True))
    return out
