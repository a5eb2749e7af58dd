"""A model's arithmetic: flops of its linears per token, and of prefilling a prompt."""

from __future__ import annotations


def linear_flops_per_token(a) -> int:
    """2 flops per weight of every layer's projections and MLP (embeddings are lookups); of
    a MoE layer, the router and the token's top-k experts."""
    qkv = a.dim * (a.n_heads + 2 * a.n_kv_heads) * a.head_dim
    out = a.n_heads * a.head_dim * a.dim
    mlp = (3 if a.spec.gated_mlp else 2) * a.dim * a.intermediate_size
    moe = a.dim * a.n_experts + a.top_k * 3 * a.dim * a.moe_intermediate_size
    mlps = sum(moe if a.is_moe_layer(i) else mlp for i in range(a.n_layers))
    return 2 * (a.n_layers * (qkv + out) + mlps)


def prefill_flops(a, prompt: int, sampled_rows: int = 1) -> int:
    """Model flops of prefilling one `prompt`-token sequence from scratch."""
    # The token at position p attends to p + 1 keys: QK^T and PV are 2 x 2 flops per key
    # and head dimension; summed over p it is prompt * (prompt + 1) / 2 key visits.
    keys = prompt * (prompt + 1) // 2
    attention = 4 * a.n_layers * a.n_heads * a.head_dim * keys
    head = 2 * a.dim * a.vocab_size * sampled_rows
    return prompt * linear_flops_per_token(a) + attention + head
