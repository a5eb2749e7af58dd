"""Next-token sampling for a whole step at once, on the logits' device.

Greedy rows take the argmax. Sampled rows are divided by their temperature, cut to their
top-k (every token tied with the k-th stays) and to their top-p (the smallest prefix of the
sorted probabilities whose mass reaches top_p; the first token always stays), and drawn by an
exponential race: argmax(p / E) with E ~ Exp(1) per token picks token i with probability
p_i / sum(p), so no normalisation, cumulative sum or host round trip is needed to draw.

The noise of a seeded turn comes from its own generator on the device (the same seed gives the
same tokens whatever else is in the batch); unseeded rows share the sampler's generator and
are drawn in one call. The step's tokens come back to the host in one copy: at once, or (a
lagged step, `Sampled`) non-blocking into page-locked memory, waited for a step later.

Constrained rows (engine/guide.py) first get their step's mask: tokens their grammar does not
allow, and stop tokens before `min_tokens`, are set to -inf on the logits' device, so both
the greedy argmax and the draw see only allowed tokens. Steps without one pay nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.types import SamplingParams

if TYPE_CHECKING:
    from engine.guide import StepMask

TINY = torch.finfo(torch.float32).tiny  # noise floor: a zero draw would divide by zero


def make_generator(params: SamplingParams, device: torch.device | str = "cpu"):
    """A seeded turn's own generator on `device`; None for greedy or unseeded turns."""
    if params.temperature == 0.0 or params.seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed)
    return g


@dataclass
class Sampled:
    """A step's sampled tokens, one per sampling piece: on the device (what the next step's
    placeholders are filled from, engine/request.py) and on their way to the host."""

    tokens: torch.Tensor  # [R] int64, on the device
    host: torch.Tensor  # its copy on the host: page-locked on CUDA, written asynchronously
    ready: torch.cuda.Event | None = None  # recorded after the copy (CUDA)

    @classmethod
    def of(cls, tokens: torch.Tensor) -> Sampled:
        """Start the copy of `tokens` to the host; nothing waits for it yet."""
        if tokens.device.type != "cuda":
            return cls(tokens, tokens)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(tokens, host, ready)

    def tolist(self) -> list[int]:
        """The tokens, once their copy is done (the host waits here, not at the launch)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


class Sampler:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.gen = torch.Generator(device=self.device)  # unseeded turns
        self.gen.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        gens: list[torch.Generator | None],
        mask: StepMask | None = None,
        to_list: bool = True,
    ) -> list[int] | torch.Tensor:
        """logits [R, vocab] (any float dtype; masked rows are written in place); one token
        per row: a list, or (`to_list` False) an int64 tensor on the device, not waited for."""
        if mask is not None:
            apply_mask(logits, mask)
        out = logits.argmax(dim=-1)
        hot = [r for r, p in enumerate(params) if p.temperature > 0.0]
        if hot:
            idx = None if len(hot) == len(params) else torch.tensor(hot, device=logits.device)
            rows = logits if idx is None else logits.index_select(0, idx)
            drawn = self.draw(rows, [params[r] for r in hot], [gens[r] for r in hot])
            out = drawn if idx is None else out.index_copy(0, idx, drawn)
        return out.tolist() if to_list else out

    def draw(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        gens: list[torch.Generator | None],
    ) -> torch.Tensor:
        """Rows that all sample (temperature > 0): one token id per row, on the device."""
        dev = logits.device
        n, vocab = logits.shape
        temp = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        x = logits.float() / temp.to(dev, non_blocking=True)[:, None]
        order = None
        if any(p.top_k or p.top_p < 1.0 for p in params):
            x, order = x.sort(dim=-1, descending=True)
            if any(p.top_k for p in params):
                k = [min(p.top_k, vocab) if p.top_k else vocab for p in params]
                kth = x.gather(1, torch.tensor(k, device=dev)[:, None] - 1)
                x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if order is not None and any(p.top_p < 1.0 for p in params):
            # rows without top-p get a bound no mass reaches (float sums can pass 1.0)
            top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params])
            before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above
            probs = probs.masked_fill(before >= top_p.to(dev, non_blocking=True)[:, None], 0.0)
        noise = torch.empty_like(probs)
        if any(g is None for g in gens):
            noise.exponential_(generator=self.gen)
        for r, g in enumerate(gens):
            if g is not None:
                noise[r].exponential_(generator=g)
        pick = probs.div_(noise.clamp_min_(TINY)).argmax(dim=-1)
        return pick if order is None else order.gather(1, pick[:, None]).squeeze(1)


def _byte_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: for each byte value, 0 where its bit k is set and -inf where it is not."""
    bit = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    return torch.where(bit == 1, 0.0, float("-inf")).to(device=device, dtype=dtype)


_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def bias_of(bits: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, words] int32 bitmasks -> [n, vocab] additive bias: 0 where the token's bit is set,
    -inf elsewhere (and for tokens past the bitmask). A byte lookup: on the CPU far faster
    than a boolean masked fill, and the same code on a GPU."""
    key = (bits.device, dtype)
    if key not in _TABLES:
        _TABLES[key] = _byte_table(bits.device, dtype)
    n = bits.shape[0]
    bias = torch.nn.functional.embedding(bits.view(torch.uint8).long(), _TABLES[key])
    bias = bias.view(n, -1)  # little-endian words: byte j of word w holds tokens 32w+8j..
    if bias.shape[1] < vocab:  # the tokenizer knows fewer tokens than the model's logits
        bias = torch.nn.functional.pad(bias, (0, vocab - bias.shape[1]), value=float("-inf"))
    return bias[:, :vocab]


@torch.inference_mode()  # the model's logits are inference tensors: written in place here
def apply_mask(logits: torch.Tensor, mask: StepMask) -> None:
    """Set the logits of every token a row may not take to -inf, in place."""
    dev = logits.device
    n_rows, vocab = logits.shape
    if mask.bits is not None and mask.rows:
        bias = bias_of(mask.bits.to(dev, non_blocking=True), vocab, logits.dtype)
        if mask.rows == list(range(n_rows)):
            logits.add_(bias)
        else:
            logits.index_add_(0, torch.tensor(mask.rows, device=dev), bias)
    if mask.banned:
        r = [row for row, ids in mask.banned for _ in ids]
        t = [i for _, ids in mask.banned for i in ids]
        logits[torch.tensor(r, device=dev), torch.tensor(t, device=dev)] = float("-inf")
