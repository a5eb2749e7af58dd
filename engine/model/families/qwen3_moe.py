"""qwen3_moe: Qwen3's attention with routed experts in place of the MLP; checkpoints with
the experts one by one or fused."""

from __future__ import annotations

from collections.abc import Collection

from engine.model.families.base import Shape, UnsupportedModel, WeightMap
from engine.model.families.llama import llama_like, llama_names, read_llama_like, write_llama_like

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
    fields = read_llama_like("qwen3_moe", config)
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


def _write_qwen3_moe(a: Shape) -> dict:
    return write_llama_like(a) | {
        "num_experts": a.n_experts,
        "num_experts_per_tok": a.top_k,
        "norm_topk_prob": a.norm_topk_prob,
        "moe_intermediate_size": a.moe_intermediate_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(a.dense_layers),
    }


def _moe_names(a: Shape) -> WeightMap:
    """Llama's names with experts in place of the MLP of MoE layers: the router `mlp.gate`
    and each expert's gate/up/down (as the hub's checkpoints and transformers' saves name
    them). Own tensors hold the experts stacked: `w13` expert by expert [gate | up] rows,
    `w2` expert by expert."""
    m = llama_names(a)
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


def fused_experts(wmap: WeightMap, names: Collection[str]) -> WeightMap:
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


QWEN3_MOE = llama_like(
    "qwen3_moe",
    "Qwen3MoeForCausalLM",
    read_config=_read_qwen3_moe,
    write_config=_write_qwen3_moe,
    names=_moe_names,
    exact_window=True,
)
