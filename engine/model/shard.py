"""One rank's share of a decoder for tensor parallelism (Megatron-style).

Rank r of N holds heads [r*H/N, (r+1)*H/N) and KV heads [r*K/N, (r+1)*K/N) of every layer
(column-parallel QKV: with both ranges contiguous, each query head keeps its GQA group), the
matching columns of the output projection (row-parallel: one all-reduce), 1/N of the MLP's
intermediate size (column-parallel gate/up, row-parallel down: one all-reduce) and 1/N of the
vocabulary rows of the LM head (the logits are gathered). Embeddings and norms are replicated;
a row-parallel bias is added once, after the all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from engine.model.decoder import Decoder
from engine.model.shapes import ModelArgs


def check_divisible(args: ModelArgs, world: int) -> None:
    """Refuse, with the reason, a shape that cannot be split `world` ways."""
    if world < 1:
        raise ValueError(f"tensor_parallel must be at least 1, got {world}")
    if args.n_experts and world > 1:
        raise ValueError(
            f"tensor_parallel={world}: a {args.family} model's experts are not split across "
            "ranks (mixture-of-experts runs on one GPU)"
        )
    for what, n in (
        ("attention heads", args.n_heads),
        ("KV heads", args.n_kv_heads),
        ("MLP intermediate size", args.intermediate_size),
    ):
        if n % world:
            raise ValueError(
                f"tensor_parallel={world} does not divide the model's {n} {what}: "
                f"pick a tensor_parallel that divides {args.n_heads} attention heads, "
                f"{args.n_kv_heads} KV heads and an intermediate size of {args.intermediate_size}"
            )


def shard_args(args: ModelArgs, world: int) -> ModelArgs:
    """The shape one rank computes (its KV pool holds n_kv_heads / world heads)."""
    check_divisible(args, world)
    return replace(
        args,
        n_heads=args.n_heads // world,
        n_kv_heads=args.n_kv_heads // world,
        intermediate_size=args.intermediate_size // world,
    )


class RowParallel(nn.Module):
    """y = sum over ranks of x_r W_r^T, then the bias once."""

    def __init__(self, linear: nn.Linear, bias: torch.Tensor | None, group) -> None:
        super().__init__()
        self.linear = linear  # no bias of its own (pack_linears may swap it for a packed one)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if self.group is not None:  # None: local only (the cost profile times one rank)
            dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


class VocabParallel(nn.Module):
    """This rank's rows of the LM head; every rank gets the full logits (all-gather)."""

    def __init__(self, linear: nn.Linear, sizes: list[int], group) -> None:
        super().__init__()
        self.linear = linear
        self.sizes = sizes  # vocabulary rows of each rank (the last ones may hold fewer)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if self.group is None:
            return y
        width = max(self.sizes)
        if y.shape[-1] < width:
            y = nn.functional.pad(y, (0, width - y.shape[-1]))
        parts = [torch.empty_like(y) for _ in self.sizes]
        dist.all_gather(parts, y.contiguous(), group=self.group)
        return torch.cat([p[:, :n] for p, n in zip(parts, self.sizes, strict=True)], dim=-1)


def _rows(w: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return w.chunk(world, dim=0)[rank].clone()


def shard_tensor(args: ModelArgs, name: str, w: torch.Tensor, rank: int, world: int):
    """This rank's slice of one of the full model's tensors, in the engine's own naming
    (a copy: the full tensor can be freed)."""
    hd = args.head_dim
    q, k = args.n_heads * hd, args.n_kv_heads * hd
    part = name.rsplit(".", 2)
    module = part[-2] if len(part) >= 2 else ""
    if module == "wqkv":  # rows: [q | k | v], each split by heads
        wq, wk, wv = w.split([q, k, k], dim=0)
        return torch.cat([_rows(t, rank, world) for t in (wq, wk, wv)], dim=0)
    if module == "w13":  # rows: [gate | up]
        gate, up = w.chunk(2, dim=0)
        return torch.cat([_rows(gate, rank, world), _rows(up, rank, world)], dim=0)
    if module == "w1" or name == "lm_head.weight":
        return _rows(w, rank, world)
    if module in ("wo", "w2") and name.endswith(".weight"):
        return w.chunk(world, dim=1)[rank].clone()
    return w.clone()  # replicated (a row-parallel bias is added once, after the all-reduce)


def build_shard(
    args: ModelArgs, tensors: Iterable[tuple[str, torch.Tensor]], rank: int, world: int, group
) -> Decoder:
    """Rank `rank`'s share of the model whose own tensors `tensors` yields (one at a time:
    only this rank's slices are kept), on their device and dtype."""
    local = shard_args(args, world)
    state = {}
    for name, w in tensors:
        state[name] = shard_tensor(args, name, w, rank, world)
        if name == "embed.weight" and args.tie_embeddings:  # the tied head: its vocab rows
            state["lm_head.weight"] = shard_tensor(args, "lm_head.weight", w, rank, world)
        del w
    with torch.device("meta"):
        model = Decoder(replace(local, tie_embeddings=False))
    vocab = args.vocab_size
    sizes = [len(c) for c in torch.arange(vocab).chunk(world)]
    model.lm_head = nn.Linear(args.dim, sizes[rank], bias=False, device="meta")
    for block in model.layers:
        block.wo.bias = None  # kept by RowParallel below
        block.w2.bias = None
    biases = {n: state.pop(n) for n in list(state) if n.endswith(("wo.bias", "w2.bias"))}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"shard does not fit: missing {missing}, unexpected {unexpected}")
    model.args = local
    for i, block in enumerate(model.layers):
        block.args = local
        block.wo = RowParallel(block.wo, biases.get(f"layers.{i}.wo.bias"), group)
        block.w2 = RowParallel(block.w2, biases.get(f"layers.{i}.w2.bias"), group)
    model.lm_head = VocabParallel(model.lm_head, sizes, group)
    return model.eval()


def set_group(model: Decoder, group) -> None:
    """Turn the collectives of a shard on (a process group) or off (None)."""
    for m in model.modules():
        if isinstance(m, RowParallel | VocabParallel):
            m.group = group
