"""A Llama-family decoder in plain PyTorch whose attention reads and writes the paged KV pool."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from engine.shapes import ModelArgs


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    d = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = args.rope_scaling or {}
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        inv = inv / s["factor"]
    elif kind == "llama3":
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv = torch.where(medium, smoothed, scaled)
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope scaling {kind!r}")
    return inv


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Block(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        qkv = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = nn.Linear(args.dim, qkv, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.w13 = nn.Linear(args.dim, 2 * args.intermediate_size, bias=False)
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=False)
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.mlp_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, cos, sin, kv, meta, slots, backend) -> torch.Tensor:
        a = self.args
        t = x.shape[0]
        q, k, v = self.wqkv(self.attn_norm(x)).split(
            [a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim], dim=-1
        )
        q = q.view(t, a.n_heads, a.head_dim)
        k = k.view(t, a.n_kv_heads, a.head_dim)
        v = v.view(t, a.n_kv_heads, a.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k_cache, v_cache = kv
        kernels.write_kv(k_cache, v_cache, k, v, slots, backend=backend)
        o = kernels.paged_attention(q, k_cache, v_cache, meta, a.head_dim**-0.5, backend=backend)
        h = x + self.wo(o.reshape(t, a.n_heads * a.head_dim))
        gate, up = self.w13(self.mlp_norm(h)).chunk(2, dim=-1)
        return h + self.w2(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}  # float32 always, whatever the dtype

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            self._inv_freq[device] = rope_inv_freq(self.args).to(device)
        return self._inv_freq[device]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: kernels.AttentionMetadata,
        slots: torch.Tensor,  # [T] flat KV slot of each token
        logit_rows: torch.Tensor,  # rows whose next-token logits are wanted
        before_attention: Callable[[int], None] | None = None,
        backend: str | None = None,
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        freqs = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(x.dtype)[:, None, :]
        sin = emb.sin().to(x.dtype)[:, None, :]
        for i, layer in enumerate(self.layers):
            if before_attention is not None:
                before_attention(i)  # e.g. wait for this layer's swap-in
            x = layer(x, cos, sin, kv_caches[i], meta, slots, backend)
        x = self.norm(x.index_select(0, logit_rows))
        return self.lm_head(x).float()

    def load_hf_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load weights named as in transformers' LlamaForCausalLM, fusing qkv and gate/up."""
        own: dict[str, torch.Tensor] = {"embed.weight": state["model.embed_tokens.weight"]}
        for i in range(self.args.n_layers):
            p = f"model.layers.{i}."
            own[f"layers.{i}.wqkv.weight"] = torch.cat(
                [state[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], dim=0
            )
            own[f"layers.{i}.wo.weight"] = state[p + "self_attn.o_proj.weight"]
            own[f"layers.{i}.w13.weight"] = torch.cat(
                [state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]], dim=0
            )
            own[f"layers.{i}.w2.weight"] = state[p + "mlp.down_proj.weight"]
            own[f"layers.{i}.attn_norm.weight"] = state[p + "input_layernorm.weight"]
            own[f"layers.{i}.mlp_norm.weight"] = state[p + "post_attention_layernorm.weight"]
        own["norm.weight"] = state["model.norm.weight"]
        own["lm_head.weight"] = state.get("lm_head.weight", state["model.embed_tokens.weight"])
        missing, unexpected = self.load_state_dict(own, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(
                f"weights do not fit the model: missing {missing}, unexpected {unexpected}"
            )
        if self.args.tie_embeddings:
            self.lm_head.weight = self.embed.weight
