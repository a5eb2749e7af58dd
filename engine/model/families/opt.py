"""opt (the paper's main family): learned positions, LayerNorm, an ungated MLP, biases."""

from __future__ import annotations

from engine.model.families.base import (
    Family,
    Shape,
    UnsupportedModel,
    WeightMap,
    activation,
    add_linear,
)


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
        "hidden_act": activation(config.get("activation_function", "relu")),
    }


def _write_opt(a: Shape) -> dict:
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


def _opt_names(a: Shape) -> WeightMap:
    d, rows = "model.decoder.", a.max_position + a.spec.position_offset
    m: WeightMap = {
        "embed.weight": [(d + "embed_tokens.weight", a.vocab_size)],
        "pos_embed.weight": [(d + "embed_positions.weight", rows)],
    }
    for i in range(a.n_layers):
        p, o = f"{d}layers.{i}.", f"layers.{i}."
        attn = p + "self_attn."
        qkv = [(attn + "q_proj", a.dim), (attn + "k_proj", a.dim), (attn + "v_proj", a.dim)]
        add_linear(m, o + "wqkv", qkv, a.qkv_bias)
        add_linear(m, o + "wo", [(attn + "out_proj", a.dim)], a.o_bias)
        add_linear(m, o + "w1", [(p + "fc1", a.intermediate_size)], a.mlp_bias)
        add_linear(m, o + "w2", [(p + "fc2", a.dim)], a.mlp_bias)
        add_linear(m, o + "attn_norm", [(p + "self_attn_layer_norm", a.dim)], True)
        add_linear(m, o + "mlp_norm", [(p + "final_layer_norm", a.dim)], True)
    add_linear(m, "norm", [(d + "final_layer_norm", a.dim)], True)
    if not a.tie_embeddings:
        m["lm_head.weight"] = [("lm_head.weight", a.vocab_size)]
    return m


OPT = Family(
    "opt",
    "OPTForCausalLM",
    norm="layer",
    rope=False,
    gated_mlp=False,
    position_offset=2,  # OPT's learned table keeps rows 0 and 1 for padding
    read_config=_read_opt,
    write_config=_write_opt,
    names=_opt_names,
)
