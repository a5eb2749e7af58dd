"""How long a step takes on a device: the forward of a batch of pieces, and the copies.

Two kinds of model behind one interface (`StepCost.forward_s`, and `StepCost.host_s`: the
host's own time a step, on the step's critical path but beside the copy stream):
- `Roofline` (GPUs): per layer, the linear layers take FLOPs / (achieved matmul rate x an
  efficiency curve in tokens per step) or the weight read at HBM bandwidth, whichever is
  larger; attention takes a fixed launch plus the larger of KV bytes / the kernel's
  measured bandwidth and FLOPs / its measured rate; the LM head runs on sampled rows only.
  Its host time (scheduling, the batch, launches, sampling, handing each token over) is
  measured: a part per step and a part per sampled row, apart from the forward.
- `Fitted` (the CPU it runs on): a least-squares fit of whole measured steps on the same
  features (tokens, sampled rows, attention pairs and KV read, pieces), from
  `engine/calibrate.py`.
Constants and their sources are in `engine/sim/devices.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.cache.policy import CostModel
from engine.model.shapes import ModelArgs

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Work:
    """One piece of a step: `q` new tokens after `start` tokens of context."""

    q: int
    start: int
    sample: bool


@dataclass(frozen=True)
class Features:
    """What a step's cost depends on."""

    tokens: int  # new tokens through the linear layers
    sampled: int  # rows through the LM head
    pairs: int  # (query, key) pairs attention computes (causal within a piece)
    kv_tokens: int  # context tokens whose K and V the attention kernel reads
    pieces: int
    decode_kv: int = 0  # of kv_tokens: those of the one-token pieces
    decode_padded: int = 0  # one-token pieces x the longest of their contexts

    @staticmethod
    def of(batch: list[Work]) -> Features:
        decodes = [w.start + 1 for w in batch if w.q == 1]
        return Features(
            tokens=sum(w.q for w in batch),
            sampled=sum(w.sample for w in batch),
            pairs=sum(w.q * w.start + w.q * (w.q + 1) // 2 for w in batch),
            kv_tokens=sum(w.start + w.q for w in batch),
            pieces=len(batch),
            decode_kv=sum(decodes),
            decode_padded=len(decodes) * max(decodes, default=0),
        )

    NAMES = ("1", "tokens", "sampled", "pairs", "prompt_kv", "decode_padded", "pieces")

    def row(self) -> list[float]:
        """The fitted model's regressors (NAMES; the constant first). The CPU backend reads
        the prompts' KV as it is but pads the decodes' to the longest context of the step
        (one batched call, `kernels/reference.py`): a mixed decode batch costs its padding."""
        prompt_kv = self.kv_tokens - self.decode_kv
        return [1.0, self.tokens, self.sampled, self.pairs, prompt_kv, self.decode_padded,
                self.pieces]  # fmt: skip


class StepCost:
    """Seconds a device spends on a step: its forward, and the host's own work."""

    name: str

    def forward_s(self, batch: list[Work]) -> float:
        raise NotImplementedError

    def host_s(self, batch: list[Work]) -> float:
        """The host's time a step apart from the forward (0: `forward_s` includes it)."""
        return 0.0


@dataclass(frozen=True)
class Shape:
    """The sizes of a model that its cost depends on."""

    layers: int
    layer_params: int  # weights of one layer's linear layers
    head_params: int  # the LM head
    heads: int
    head_dim: int
    kv_bytes_per_token: int  # K and V of one token in one layer
    weight_bytes: int  # bytes per weight

    @staticmethod
    def of(args: ModelArgs, dtype: str = "bfloat16", kv_bytes: int | None = None) -> Shape:
        b = DTYPE_BYTES[dtype]
        q = args.n_heads * args.head_dim
        kv = args.n_kv_heads * args.head_dim
        mlp = (3 if args.hidden_act == "silu" else 2) * args.dim * args.intermediate_size
        return Shape(
            layers=args.n_layers,
            layer_params=args.dim * (2 * q + 2 * kv) + mlp,
            head_params=args.dim * args.vocab_size,
            heads=args.n_heads,
            head_dim=args.head_dim,
            kv_bytes_per_token=2 * kv * (b if kv_bytes is None else kv_bytes),
            weight_bytes=b,
        )


@dataclass(frozen=True)
class GPUSpec:
    """A GPU's figures (see devices.py for where each comes from)."""

    name: str
    matmul_flops: float  # achieved by a large bf16 matmul
    matmul_half_tokens: float  # tokens per step at which a linear layer reaches half of it
    hbm_bps: float  # achieved read bandwidth (weights)
    attn_launch_s: float  # attention kernel, per layer: fixed part
    attn_bps: float  # attention kernel: KV bytes per second it reads
    attn_flops: float  # attention kernel: FLOP/s on long prompts
    token_layer_s: float  # per token and layer: the unfused rest (norms, RoPE, activations)
    step_host_s: float  # the host's work per step, before the forward (devices.py: measured)
    row_host_s: float  # and per sampled row of the step
    swap_in_bps: float
    swap_out_bps: float
    swap_in_hidden: float  # share of a swap-in the layer pipeline hides behind the forward
    memory_bytes: float
    sources: tuple[str, ...]


class Roofline(StepCost):
    def __init__(self, spec: GPUSpec, shape: Shape) -> None:
        self.spec, self.shape = spec, shape
        self.name = spec.name

    def _linear_s(self, tokens: int, params: int) -> float:
        if tokens == 0:
            return 0.0
        s = self.spec
        efficiency = tokens / (tokens + s.matmul_half_tokens)
        compute = 2 * tokens * params / (s.matmul_flops * efficiency)
        return max(compute, params * self.shape.weight_bytes / s.hbm_bps)

    def forward_s(self, batch: list[Work]) -> float:
        s, m, f = self.spec, self.shape, Features.of(batch)
        if not batch:
            return 0.0
        attn_bytes = f.kv_tokens * m.kv_bytes_per_token
        attn = s.attn_launch_s + max(
            attn_bytes / s.attn_bps, 4 * f.pairs * m.heads * m.head_dim / s.attn_flops
        )
        layer = self._linear_s(f.tokens, m.layer_params) + attn + s.token_layer_s * f.tokens
        return m.layers * layer + self._linear_s(f.sampled, m.head_params)

    def host_s(self, batch: list[Work]) -> float:
        if not batch:
            return 0.0
        return self.spec.step_host_s + self.spec.row_host_s * sum(w.sample for w in batch)


@dataclass(frozen=True)
class Fitted(StepCost):
    """step_s = weights . Features.row(), fitted on measured steps of one model."""

    name: str
    weights: tuple[float, ...]

    def forward_s(self, batch: list[Work]) -> float:
        row = Features.of(batch).row()
        return sum(w * x for w, x in zip(self.weights, row, strict=True))


def chunk_costs(cost: StepCost, chunk_size: int, max_context: int, batch_tokens: int) -> CostModel:
    """The eviction policy's Cost(l), from the same model: what recomputing one chunk at
    context l adds to a step that computes a quarter of the token budget anyway (the
    weights are read once per step: a recompute pays for its own compute and attention)."""
    contexts = []
    ctx = chunk_size
    while ctx <= max(max_context, chunk_size):
        contexts.append(ctx)
        ctx *= 2
    ref = [Work(max(1, batch_tokens // 4), 0, False)]
    base = cost.forward_s(ref)
    times = [cost.forward_s([*ref, Work(chunk_size, c - chunk_size, False)]) - base
             for c in contexts]  # fmt: skip
    for i in range(1, len(times)):  # monotone, as the profiler keeps it
        times[i] = max(times[i], times[i - 1])
    return CostModel(contexts, times, 0.0)
