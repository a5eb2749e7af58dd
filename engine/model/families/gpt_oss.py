"""gpt_oss (OpenAI's gpt-oss, transformers' `GptOssForCausalLM`): sliding and full layers in
turn, attention sinks, YaRN RoPE, and in every layer routed experts with biases, a top-k
softmax and a clamped SwiGLU; expert weights as transformers holds them, or MXFP4 as the hub
ships them (dequantized when loaded)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from engine.model.families.base import (
    ROPE_TYPES,
    Shape,
    UnsupportedModel,
    WeightMap,
    add_linear,
    read_rope,
    rms_decoder_config,
    rope_parameters,
    rotary_fields,
)
from engine.model.families.llama import llama_like
from engine.model.mxfp4 import dequantize_mxfp4

# Read, and meaning nothing at inference (training and loading only).
_IGNORED = ("router_aux_loss_coef", "output_router_logits", "initializer_range")


def _read_gpt_oss(config: dict) -> dict:
    """Every layer's MLP is `num_experts_per_tok` of `num_local_experts` experts (the width of
    each is `intermediate_size`); `layer_types` says which layers slide over `sliding_window`
    keys (transformers' default: every other one, the first sliding)."""
    quant = config.get("quantization_config")
    if quant and quant.get("quant_method") != "mxfp4":
        raise UnsupportedModel(
            f"quantization {quant.get('quant_method')!r} is not supported (only mxfp4 experts, "
            "dequantized when loaded)"
        )
    theta, scaling = read_rope(config, ROPE_TYPES + ("yarn",), default_theta=150000.0)
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")} | {
            "rope_type": scaling.get("rope_type", scaling.get("type"))
        }
    fields = rotary_fields("gpt_oss", config, theta, scaling, 1e-5)
    n = fields["n_layers"]
    experts = config.get("num_local_experts", config.get("num_experts", 0))
    top_k = config["num_experts_per_tok"]
    if not 0 < top_k <= experts:
        raise UnsupportedModel(f"num_experts_per_tok {top_k} of {experts} experts")
    types = config.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if len(types) < n:
        raise UnsupportedModel(f"layer_types has {len(types)} entries for {n} layers")
    unknown = set(types[:n]) - {"sliding_attention", "full_attention"}
    if unknown:
        raise UnsupportedModel(f"layer_types {sorted(unknown)} are not supported")
    bias = bool(config.get("attention_bias", True))
    return fields | {
        "qkv_bias": bias,
        "o_bias": bias,
        "sliding_window": config.get("sliding_window"),
        "full_layers": tuple(i for i in range(n) if types[i] == "full_attention"),
        "attn_sinks": True,
        "n_experts": experts,
        "top_k": top_k,
        "moe_intermediate_size": config["intermediate_size"],
        "moe_bias": True,
        "routing": "topk_softmax",
        "swiglu_alpha": float(config.get("swiglu_alpha", 1.702)),
        "swiglu_limit": float(config.get("swiglu_limit", 7.0)),
    }


def _write_gpt_oss(a: Shape) -> dict:
    if a.qkv_bias != a.o_bias:
        raise UnsupportedModel("gpt_oss has one attention_bias for q/k/v and o")
    if a.dense_layers or a.moe_intermediate_size != a.intermediate_size:
        raise UnsupportedModel("gpt_oss has experts in every layer, intermediate_size wide")
    return rms_decoder_config(a) | {
        "rope_parameters": rope_parameters(a),
        "hidden_act": a.hidden_act,
        "attention_bias": a.qkv_bias,
        "sliding_window": a.sliding_window,
        "layer_types": [
            "full_attention" if i in a.full_layers else "sliding_attention"
            for i in range(a.n_layers)
        ],
        "num_local_experts": a.n_experts,
        "num_experts_per_tok": a.top_k,
        "swiglu_alpha": a.swiglu_alpha,
        "swiglu_limit": a.swiglu_limit,
    }


def _gpt_oss_names(a: Shape) -> WeightMap:
    """transformers' names. The experts are one tensor per projection (`experts.gate_up_proj`
    and the rest), seen as `GptOssView` presents them: [E, out, in], gate rows before up rows."""
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    e = a.n_experts
    m: WeightMap = {"embed.weight": [("model.embed_tokens.weight", a.vocab_size)]}
    for i in range(a.n_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        qkv = [(attn + "q_proj", q), (attn + "k_proj", kv), (attn + "v_proj", kv)]
        add_linear(m, o + "wqkv", qkv, a.qkv_bias)
        add_linear(m, o + "wo", [(attn + "o_proj", a.dim)], a.o_bias)
        m[o + "sinks"] = [(attn + "sinks", a.n_heads)]
        add_linear(m, o + "moe.router", [(mlp + "router", e)], True)
        m[o + "moe.w13"] = [(mlp + "experts.gate_up_proj", e)]
        m[o + "moe.b13"] = [(mlp + "experts.gate_up_proj_bias", e)]
        m[o + "moe.w2"] = [(mlp + "experts.down_proj", e)]
        m[o + "moe.b2"] = [(mlp + "experts.down_proj_bias", e)]
        m[o + "attn_norm.weight"] = [(p + "input_layernorm.weight", a.dim)]
        m[o + "mlp_norm.weight"] = [(p + "post_attention_layernorm.weight", a.dim)]
    m["norm.weight"] = [("model.norm.weight", a.dim)]
    if not a.tie_embeddings:
        m["lm_head.weight"] = [("lm_head.weight", a.vocab_size)]
    return m


def _split(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate/up (gate at even indices of `dim`, up at odd) as [gate | up]."""
    n = t.shape[dim]
    return torch.cat(
        [t.narrow(dim, 0, n).unflatten(dim, (n // 2, 2)).select(dim + 1, j) for j in (0, 1)],
        dim=dim,
    )


def _interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of `_split`: [gate | up] on `dim` back to gate, up, gate, up, ..."""
    gate, up = t.chunk(2, dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


_GATE_UP, _DOWN = "experts.gate_up_proj", "experts.down_proj"


class GptOssView(Mapping):
    """A gpt-oss checkpoint as the engine's names expect its experts: `gate_up_proj` [E, 2I, H]
    with each expert's gate rows before its up rows and `down_proj` [E, H, I] (out, in), from
    transformers' layout ([E, H, 2I] interleaved, [E, I, H]) or from the hub's MXFP4 blocks and
    scales (`*_blocks`, `*_scales`: [E, out, in] already, dequantized here, when read). Every
    other tensor reads through unchanged."""

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self.state = state
        self.names = []
        for k in state:
            base = k.removesuffix("_blocks").removesuffix("_scales")
            if base == k:
                self.names.append(k)
            elif base + "_blocks" in state and base + "_scales" in state:
                if k.endswith("_blocks"):
                    self.names.append(base)  # the pair, seen as the weight they make
            else:
                self.names.append(k)  # half a pair: left for the names check to refuse
        self.known = set(self.names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.known:
            raise KeyError(name)
        packed = name not in self.state
        if name.endswith((_GATE_UP, _DOWN)):
            if packed:
                w = dequantize_mxfp4(self.state[name + "_blocks"], self.state[name + "_scales"])
            else:
                w = self.state[name].transpose(1, 2)
            return _split(w, 1).contiguous() if name.endswith(_GATE_UP) else w.contiguous()
        if name.endswith(_GATE_UP + "_bias"):
            return _split(self.state[name], 1)
        return self.state[name]

    def __contains__(self, name: object) -> bool:
        return name in self.known

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _gpt_oss_unview(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `GptOssView` (unquantized): experts in transformers' layout."""
    out = {}
    for name, t in hf.items():
        if name.endswith(_GATE_UP):
            t = _interleave(t, 1).transpose(1, 2)
        elif name.endswith(_DOWN):
            t = t.transpose(1, 2)
        elif name.endswith(_GATE_UP + "_bias"):
            t = _interleave(t, 1)
        out[name] = t.contiguous()
    return out


GPT_OSS = llama_like(
    "gpt_oss",
    "GptOssForCausalLM",
    read_config=_read_gpt_oss,
    write_config=_write_gpt_oss,
    names=_gpt_oss_names,
    exact_window=True,
    view=GptOssView,
    unview=_gpt_oss_unview,
)
