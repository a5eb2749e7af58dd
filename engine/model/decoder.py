"""The decoder of every supported family (engine/model/families/) in plain PyTorch; its attention
reads and writes the paged KV pool."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

import kernels
from engine.model.families.base import ACTIVATIONS
from engine.model.families.checkpoint import to_hf, to_own
from engine.model.moe import MoE
from engine.model.shapes import ModelArgs


def rope_inv_freq(args: ModelArgs, local: bool = False) -> torch.Tensor:
    """`local`: for Gemma 3's sliding layers (their own base, never scaled)."""
    if local:
        args = replace(args, rope_theta=args.rope_local_theta, rope_scaling=None)
    d = args.rotary_dim
    powers = args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    inv = 1.0 / powers
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
    elif kind == "longrope":  # the short factors: the context stops at the original length
        inv = 1.0 / (torch.tensor(s["short_factor"], dtype=torch.float32) * powers)
    elif kind == "yarn":
        inv = _yarn_inv_freq(args, s, powers)
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope scaling {kind!r}")
    return inv


def _yarn_factor(args: ModelArgs, s: dict) -> float:
    return s.get("factor") or args.max_position / s["original_max_position_embeddings"]


def _yarn_inv_freq(args: ModelArgs, s: dict, powers: torch.Tensor) -> torch.Tensor:
    """YaRN (gpt-oss): frequencies that turn fewer than `beta_slow` times over the original
    length are interpolated (divided by the factor), those that turn more than `beta_fast`
    times kept, a linear ramp between (over dims, bounds floored and ceiled where
    `truncate`), as transformers' `_compute_yarn_parameters`."""
    d, base, old = args.rotary_dim, args.rope_theta, s["original_max_position_embeddings"]

    def dim_of(turns: float) -> float:
        return d * math.log(old / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(s.get("beta_fast") or 32), dim_of(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of each frequency kept as it is
    return 1.0 / (_yarn_factor(args, s) * powers) * (1 - keep) + 1.0 / powers * keep


def rope_attention_factor(args: ModelArgs) -> float:
    """What cos and sin are multiplied by (LongRoPE's and YaRN's attention factor; 1
    otherwise)."""
    s = args.rope_scaling or {}
    if s.get("rope_type") == "yarn":
        if s.get("attention_factor") is not None:
            return s["attention_factor"]
        factor = _yarn_factor(args, s)

        def mscale(m: float = 1.0) -> float:
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

        if s.get("mscale") and s.get("mscale_all_dim"):
            return mscale(s["mscale"]) / mscale(s["mscale_all_dim"])
        return mscale()
    if s.get("rope_type") != "longrope":
        return 1.0
    if s.get("attention_factor") is not None:
        return s["attention_factor"]
    old_len = s["original_max_position_embeddings"]
    factor = s.get("factor") or args.max_position / old_len
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, 1, rotary_dim]


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """x [T, heads, head_dim] rotated on its first rotary_dim dims; the rest pass through."""
    cos, sin = rope
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    head, tail = x[..., :r], x[..., r:]
    return torch.cat((head * cos + rotate_half(head) * sin, tail), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: scaled by 1 + weight, in float32, then cast (Llama casts first)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def make_norm(args: ModelArgs, dim: int | None = None) -> nn.Module:
    dim = dim or args.dim
    if args.spec.norm == "layer":
        return nn.LayerNorm(dim, eps=args.norm_eps)
    if args.spec.norm == "gemma":
        return GemmaRMSNorm(dim, args.norm_eps)
    return RMSNorm(dim, args.norm_eps)


def add_norm(
    norm: nn.Module, x: torch.Tensor, delta: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual x + delta and its norm (fused path): one Triton kernel for an RMSNorm."""
    if isinstance(norm, RMSNorm):
        return kernels.add_rms_norm(x, delta, norm.weight, norm.eps)
    h = x if delta is None else x + delta
    return h, norm(h)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, index: int = 0) -> None:
        super().__init__()
        self.args = args
        # Whether this layer rotates q and k (SmolLM3 leaves some layers without positions).
        self.uses_rope = args.spec.rope and index not in args.no_rope_layers
        self.window = args.window(index)  # its sliding window (None: every key)
        self.kv_group = 0  # the page group its KV is in (engine/kv_layout.py; set_kv_groups)
        # Gemma 3's sliding layers rotate with a base of their own.
        self.local_rope = self.window is not None and args.rope_local_theta is not None
        self.sandwich = args.spec.sandwich
        self.gated = args.spec.gated_mlp
        self.act = ACTIVATIONS[args.hidden_act]
        qkv = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = nn.Linear(args.dim, qkv, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=args.o_bias)
        # Routed experts in place of the dense MLP (Qwen3-MoE; engine/model/moe.py)
        self.moe = MoE(args) if args.is_moe_layer(index) else None
        if self.moe is None:
            ffn = args.intermediate_size
            if self.gated:
                self.w13 = nn.Linear(args.dim, 2 * ffn, bias=args.mlp_bias)
            else:
                self.w1 = nn.Linear(args.dim, ffn, bias=args.mlp_bias)
            self.w2 = nn.Linear(ffn, args.dim, bias=args.mlp_bias)
        self.attn_norm = make_norm(args)
        self.mlp_norm = make_norm(args)
        if self.sandwich:  # on each branch's output, before the residual add
            self.post_attn_norm = make_norm(args)
            self.post_mlp_norm = make_norm(args)
        if args.qk_norm:  # per head, over head_dim
            self.q_norm = make_norm(args, args.head_dim)
            self.k_norm = make_norm(args, args.head_dim)
        # gpt-oss: each query head's sink logit (kernels.paged_attention)
        self.sinks = nn.Parameter(torch.zeros(args.n_heads)) if args.attn_sinks else None

    def qkv(self, x: torch.Tensor, rope: Rope | None) -> tuple[torch.Tensor, ...]:
        """Queries, keys and values of normed `x`, rotated where the family uses rope."""
        a = self.args
        t = x.shape[0]
        q, k, v = self.wqkv(x).split(
            [a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim], dim=-1
        )
        q = q.view(t, a.n_heads, a.head_dim)
        k = k.view(t, a.n_kv_heads, a.head_dim)
        v = v.view(t, a.n_kv_heads, a.head_dim)
        if a.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        return q, k, v

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.moe is not None:
            return self.moe(x)
        if self.gated:
            gate, up = self.w13(x).chunk(2, dim=-1)
            return self.w2(self.act(gate) * up)
        return self.w2(self.act(self.w1(x)))

    def forward(self, x, rope, kv, meta, slots, backend) -> torch.Tensor:
        a = self.args
        t = x.shape[0]
        q, k, v = self.qkv(self.attn_norm(x), rope)
        k_cache, v_cache = kv
        if torch.compiler.is_compiling():  # one opaque op (engine/model/compiled.py)
            o = torch.ops.pensieve.attend_paged(
                q,
                k,
                v,
                k_cache,
                v_cache,
                slots,
                a.attn_scale,
                self.window,
                self.sinks,
                self.kv_group,
            )
        else:
            kernels.write_kv(k_cache, v_cache, k, v, slots, backend=backend)
            o = self.attend(q, kv, meta, backend)
        attn = self.wo(o.reshape(t, a.n_heads * a.head_dim))
        h = x + (self.post_attn_norm(attn) if self.sandwich else attn)
        m = self.mlp(self.mlp_norm(h))
        return h + (self.post_mlp_norm(m) if self.sandwich else m)

    def attend(self, q, kv, meta, backend) -> torch.Tensor:
        k_cache, v_cache = kv
        return kernels.paged_attention(
            q,
            k_cache,
            v_cache,
            meta,
            self.args.attn_scale,
            backend=backend,
            window=self.window,
            sinks=self.sinks,
        )

    def forward_fused(self, x, delta, rope, kv, meta, slots, backend) -> tuple[torch.Tensor, ...]:
        """`forward` with fused elementwise kernels (the Triton backend on CUDA). The residual
        stream comes and goes as (x, delta), delta the last MLP output not yet added, so that
        each residual add is fused with the norm after it; RoPE is fused with the KV write."""
        a = self.args
        t = x.shape[0]
        k_cache, v_cache = kv
        x, n = add_norm(self.attn_norm, x, delta)
        # The fused kernel rotates whole heads of the projection's raw q and k.
        if rope is None or a.qk_norm or a.rotary_dim != a.head_dim:
            q, k, v = self.qkv(n, rope)
            kernels.write_kv(k_cache, v_cache, k, v, slots, backend=backend)
        else:
            cos, sin = rope
            q = kernels.rope_write_kv(
                self.wqkv(n), cos, sin, k_cache, v_cache, slots, a.n_heads, a.n_kv_heads, a.head_dim
            )
        o = self.attend(q, kv, meta, backend)
        attn = self.wo(o.reshape(t, a.n_heads * a.head_dim))
        h, n = add_norm(self.mlp_norm, x, self.post_attn_norm(attn) if self.sandwich else attn)
        if self.gated and a.hidden_act == "silu" and self.moe is None:
            m = self.w2(kernels.silu_mul(self.w13(n)))
        else:
            m = self.mlp(n)
        return h, (self.post_mlp_norm(m) if self.sandwich else m)


class Decoder(nn.Module):
    """A pre-norm decoder-only transformer; `args.family` picks norms, positions and MLP."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        spec = args.spec
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embed = (
            None if spec.rope else nn.Embedding(args.max_position + spec.position_offset, args.dim)
        )
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        self.norm = make_norm(args)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie()
        # float32 always, whatever the dtype; by device and whether for local layers
        self._inv_freq: dict[tuple[torch.device, bool], torch.Tensor] = {}
        # Gemma: sqrt(dim) rounded to the embedding's dtype, as transformers multiplies
        # (55.4256 is 55.5 in bfloat16). Plain floats: no tensor to move or to trace.
        root = torch.tensor(args.dim**0.5, device="cpu")
        self.embed_scale = {
            dt: root.to(dt).item() for dt in (torch.float32, torch.bfloat16, torch.float16)
        }
        # Fused elementwise kernels: None = for the Triton backend on CUDA only (tests force it).
        self.fused: bool | None = None
        # Per layer, its page group (engine/kv_layout.py), read when a step's block tables
        # come one per group (`set_kv_groups`)
        self.kv_groups: tuple[int, ...] = (0,) * args.n_layers

    def set_kv_groups(self, groups: tuple[int, ...]) -> None:
        """Each layer's page group, as the pool lays its KV out."""
        self.kv_groups = tuple(groups)
        for layer, g in zip(self.layers, groups, strict=True):
            layer.kv_group = g

    def tie(self) -> None:
        """Share the embedding with the LM head where the config ties them (again after a
        move that made copies, e.g. `to_empty`)."""
        if self.args.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def inv_freq(self, device: torch.device, local: bool = False) -> torch.Tensor:
        if (device, local) not in self._inv_freq:
            self._inv_freq[device, local] = rope_inv_freq(self.args, local).to(device)
        return self._inv_freq[device, local]

    def rope(self, positions: torch.Tensor, dtype: torch.dtype, local: bool = False) -> Rope:
        freqs = positions.float()[:, None] * self.inv_freq(positions.device, local)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        factor = rope_attention_factor(self.args)
        if factor != 1.0:  # in float32, before the cast, as transformers does
            cos, sin = cos * factor, sin * factor
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

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
        if self.args.spec.scaled_embed:
            x = x * self.embed_scale[x.dtype]
        if self.pos_embed is None:
            rope = local_rope = self.rope(positions, x.dtype)
            if self.args.rope_local_theta is not None:
                local_rope = self.rope(positions, x.dtype, local=True)
        else:
            rope = local_rope = None
            x = x + self.pos_embed(positions + self.args.spec.position_offset)
        fused = self.fused
        if fused is None:
            fused = x.is_cuda and kernels.pick_backend(x.device, backend) == "triton"
        delta = None  # fused path: the last MLP output, added in the next norm's kernel
        grouped = slots.dim() == 2  # page groups: [G, T] slots, [G, S, W] tables
        for i, layer in enumerate(self.layers):
            if before_attention is not None:
                before_attention(i)  # e.g. wait for this layer's swap-in
            r = (local_rope if layer.local_rope else rope) if layer.uses_rope else None
            m, s = meta, slots
            if grouped:  # this layer's pages: its group's tables and slots
                g = self.kv_groups[i]
                m, s = (None if meta is None else meta.group(g)), slots[g]
            if fused:
                x, delta = layer.forward_fused(x, delta, r, kv_caches[i], m, s, backend)
            else:
                x = layer(x, r, kv_caches[i], m, s, backend)
        if fused:
            rows = delta.index_select(0, logit_rows)
            _, x = add_norm(self.norm, x.index_select(0, logit_rows), rows)
        else:
            x = self.norm(x.index_select(0, logit_rows))
        logits = self.lm_head(x)
        cap = self.args.final_softcap
        if cap:  # in the model's dtype, as transformers does
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def load_hf_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load a checkpoint in transformers' naming (strict: see engine/model/families/checkpoint.py)."""
        own = to_own(self.args, state)
        if self.args.tie_embeddings:
            own["lm_head.weight"] = own["embed.weight"]
        missing, unexpected = self.load_state_dict(own, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(
                f"weights do not fit the model: missing {missing}, unexpected {unexpected}"
            )
        self.tie()

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The weights in transformers' naming (what `load_hf_state` reads)."""
        return to_hf(self.args, self.state_dict())
