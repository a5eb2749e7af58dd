"""The Llama-like families: llama, qwen2, mistral, qwen3, smollm3 (rotary positions, RMS
norms, a gated MLP, Llama's checkpoint names), and the readers, writers and names the
other rotary families build on."""

from __future__ import annotations

from functools import partial

from engine.model.families.base import (
    FULL,
    SLIDING,
    Family,
    Shape,
    UnsupportedModel,
    WeightMap,
    add_linear,
    layer_types,
    layer_windows,
    read_rope,
    rms_decoder_config,
    rope_parameters,
    rotary_fields,
)


def read_llama_like(model_type: str, config: dict) -> dict:
    theta, scaling = read_rope(config, default_theta=2e6 if model_type == "smollm3" else 10000.0)
    fields = rotary_fields(model_type, config, theta, scaling, 1e-6)
    if model_type == "llama":
        bias = bool(config.get("attention_bias", False))
        fields |= {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(config.get("mlp_bias"))}
    elif model_type == "qwen2":  # q/k/v always carry biases; o and the MLP never do
        fields["qkv_bias"] = True
    elif model_type in ("qwen3", "qwen3_moe"):  # q/k norms; one attention_bias for q/k/v and o
        bias = bool(config.get("attention_bias", False))
        fields |= {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}
    elif model_type == "smollm3":
        bias = bool(config.get("attention_bias", False))
        fields |= {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(config.get("mlp_bias"))}
        fields["no_rope_layers"] = _smollm3_no_rope(config)
    return fields | _read_windows(model_type, config, fields)


def _read_windows(model_type: str, config: dict, fields: dict) -> dict:
    """Which layers slide, and over how many keys, as transformers' config and model place
    them (5.17 to 5.24 alike):
    - mistral: every layer over `sliding_window` (None: no window).
    - qwen2, qwen3: `layer_types` where the config has it (transformers 5 writes it), else
      the layers from `max_window_layers` on (default 28); none unless `use_sliding_window`.
    - qwen3_moe: every layer, when `use_sliding_window` (its model ignores
      `max_window_layers` and `layer_types`: one mask for all layers).
    - smollm3: `layer_types`, else the layers without RoPE, when `use_sliding_window`.
    """
    n, window, types = fields["n_layers"], config.get("sliding_window"), config.get("layer_types")
    if model_type in ("mistral", "qwen3_moe"):
        types = None
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not config.get("use_sliding_window"):
        window = None
    if model_type in ("qwen2", "qwen3") and types is None:
        start = config.get("max_window_layers", 28)
        types = [SLIDING if window is not None and i >= start else FULL for i in range(n)]
    elif model_type == "smollm3":
        use = config.get("use_sliding_window")
        if types is None:
            slides = use and window is not None
            no_rope = fields["no_rope_layers"]
            types = [SLIDING if slides and i in no_rope else FULL for i in range(n)]
        elif SLIDING in types[:n] and not use:
            # sdpa and eager would slide these layers (the mask follows layer_types), flash
            # attention would not (its window follows use_sliding_window)
            raise UnsupportedModel(
                "smollm3: layer_types has sliding layers but use_sliding_window is off"
            )
    elif model_type == "llama":
        return {}
    return layer_windows(window, types, n)


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


def write_llama_like(a: Shape) -> dict:
    config = rms_decoder_config(a) | {
        "rope_theta": a.rope_theta,
        "rope_parameters": rope_parameters(a),
        "hidden_act": a.hidden_act,
    }
    if a.family == "llama":
        if a.qkv_bias != a.o_bias:
            raise UnsupportedModel("a llama config has one attention_bias for q/k/v and o")
        config |= {"attention_bias": a.qkv_bias, "mlp_bias": a.mlp_bias}
    elif a.family in ("qwen2", "mistral"):
        config |= write_windows(a)
    elif a.family in ("qwen3", "smollm3", "qwen3_moe"):
        if a.qkv_bias != a.o_bias:
            raise UnsupportedModel(f"a {a.family} config has one attention_bias for q/k/v and o")
        config |= {"attention_bias": a.qkv_bias} | write_windows(a)
        if a.family == "smollm3":
            config["mlp_bias"] = a.mlp_bias
            config["no_rope_layers"] = [int(i not in a.no_rope_layers) for i in range(a.n_layers)]
    return config


def write_windows(a: Shape) -> dict:
    """The window keys transformers reads back as this shape (and as the readers do)."""
    if a.family in ("mistral", "qwen3_moe", "phi3"):
        if a.full_layers and a.sliding_window is not None:
            raise UnsupportedModel(f"{a.family}: every layer slides, or none")
        if a.family != "qwen3_moe":
            return {"sliding_window": a.sliding_window}
    config = {
        "use_sliding_window": a.sliding_window is not None,
        "sliding_window": a.sliding_window,
    }
    if a.family in ("qwen2", "qwen3", "smollm3"):
        types = config["layer_types"] = layer_types(a)
        full = types.count(FULL)
        if a.family != "smollm3" and SLIDING not in types[:full]:
            config["max_window_layers"] = full  # says the same, for readers without types
    return config


def llama_names(a: Shape, fused: bool = False) -> WeightMap:
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
        add_linear(m, o + "wqkv", qkv, a.qkv_bias)
        add_linear(m, o + "wo", [(attn + "o_proj", a.dim)], a.o_bias)
        add_linear(m, o + "w13", gate_up, a.mlp_bias)
        add_linear(m, o + "w2", [(p + "mlp.down_proj", a.dim)], a.mlp_bias)
        m[o + "attn_norm.weight"] = [(p + "input_layernorm.weight", a.dim)]
        m[o + "mlp_norm.weight"] = [(p + "post_attention_layernorm.weight", a.dim)]
        if a.qk_norm:
            m[o + "q_norm.weight"] = [(attn + "q_norm.weight", a.head_dim)]
            m[o + "k_norm.weight"] = [(attn + "k_norm.weight", a.head_dim)]
    m["norm.weight"] = [("model.norm.weight", a.dim)]
    if not a.tie_embeddings:
        m["lm_head.weight"] = [("lm_head.weight", a.vocab_size)]
    return m


def llama_like(model_type: str, architecture: str, **kw) -> Family:
    fields = {
        "norm": "rms",
        "rope": True,
        "gated_mlp": True,
        "position_offset": 0,
        "read_config": partial(read_llama_like, model_type),
        "write_config": write_llama_like,
        "names": llama_names,
    }
    return Family(model_type, architecture, **fields | kw)


LLAMA = llama_like("llama", "LlamaForCausalLM")
QWEN2 = llama_like("qwen2", "Qwen2ForCausalLM", exact_window=True)
MISTRAL = llama_like("mistral", "MistralForCausalLM", exact_window=True)
QWEN3 = llama_like("qwen3", "Qwen3ForCausalLM", exact_window=True)
SMOLLM3 = llama_like("smollm3", "SmolLM3ForCausalLM", exact_window=True)
