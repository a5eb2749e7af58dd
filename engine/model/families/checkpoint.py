"""Checkpoints in transformers' naming to the decoder's own tensors and back.

Each family's names say which checkpoint tensors make each of the decoder's own (q/k/v and
gate/up are fused, concatenated on dim 0). Loading is strict both ways: a tensor the model
needs that the checkpoint lacks, or one the checkpoint has that the model would not use,
refuses the checkpoint by name. No weight is dropped silently; only buffers that are not
weights (`_NOT_WEIGHTS`) are skipped.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from engine.model.families.base import Shape, UnsupportedModel
from engine.model.families.qwen3_moe import fused_experts

# Buffers some checkpoints carry that the model recomputes: not weights, safe to skip.
_NOT_WEIGHTS = (".rotary_emb.inv_freq",)


def _shown(names: list[str], most: int = 8) -> str:
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def to_own(args: Shape, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The decoder's own tensors from a checkpoint in transformers' naming; refuses a
    checkpoint with missing tensors or with tensors the model would not use."""
    return dict(iter_own(args, state))


def iter_own(args: Shape, state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """`to_own` one tensor at a time: with a lazy `state` (tensors read when looked up), a
    caller that keeps only a slice of each never holds the whole checkpoint. The names are
    checked before the first tensor is read."""
    if not any(k.startswith("model.") for k in state):  # saved from the base model (OPTModel)
        base = state
        state = _Renamed({(k if k == "lm_head.weight" else "model." + k): k for k in base}, base)
    if args.spec.view is not None:
        state = args.spec.view(state)
    wmap = fused_experts(args.spec.names(args), state.keys())
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
        # Experts fused in one tensor [E, ...] (weights; gpt-oss's biases too): stacked rows
        flat = 2 if name.endswith(_STACKED_BIASES) else 3
        tensors = [t.flatten(0, 1) if t.dim() == flat else t for t in tensors]
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


_STACKED_BIASES = (".moe.b13", ".moe.b2")  # [E * out] own, [E, out] fused in a checkpoint


def to_hf(args: Shape, own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `to_own`: the decoder's tensors in transformers' naming."""
    out = {}
    for name, parts in args.spec.names(args).items():
        t = own[name]
        fused = ".moe.w" in name or name.endswith(_STACKED_BIASES)
        if len(parts) == 1 and fused and t.shape[0] != parts[0][1]:
            out[parts[0][0]] = t.unflatten(0, (parts[0][1], -1)).contiguous()  # fused experts
            continue
        pieces = t.split([rows for _, rows in parts])
        out.update((hf, t.contiguous()) for (hf, _), t in zip(parts, pieces, strict=True))
    return args.spec.unview(out) if args.spec.unview is not None else out
