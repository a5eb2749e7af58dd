"""Next-token sampling: greedy, temperature, top-k, top-p, with a per-turn seeded generator."""

from __future__ import annotations

import torch

from engine.types import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.temperature == 0.0:
        return None
    g = torch.Generator()
    g.manual_seed(params.seed if params.seed is not None else torch.seed())
    return g


def sample(
    logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]
) -> list[int]:
    """logits [R, vocab] float32 on any device; one token per row."""
    out = logits.argmax(dim=-1).tolist()
    for r, p in enumerate(params):
        if p.temperature == 0.0:
            continue
        row = logits[r].float().cpu() / p.temperature
        if p.top_k:
            kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = sorted_p.cumsum(0) - sorted_p >= p.top_p
            sorted_p[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        out[r] = int(torch.multinomial(probs, 1, generator=gens[r]).item())
    return out
