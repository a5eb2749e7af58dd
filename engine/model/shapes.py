"""Model shape: the config dataclass every loader produces, and the named dummy shapes."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.model.families import FAMILIES, family_of
from engine.model.families.base import Family


@dataclass
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # {"rope_type": "llama3" | "linear" | "longrope" | "yarn", "factor": ..., ...}
    rope_scaling: dict | None = None
    max_position: int = 4096
    tie_embeddings: bool = False
    family: str = "llama"  # a key of engine.model.families.FAMILIES (the transformers model_type)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    # Keys `sliding_window` or more positions back are not attended, in every layer but
    # `full_layers` (Mistral, Phi-3, Qwen3-MoE: every layer; Gemma 3, and Qwen2, Qwen3 and
    # SmolLM3 where their configs slide: the layers transformers' `layer_types` says slide).
    sliding_window: int | None = None
    full_layers: tuple[int, ...] = ()  # the global layers: no window
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's q and k, before RoPE
    no_rope_layers: tuple[int, ...] = ()  # SmolLM3: layers whose q/k are not rotated
    partial_rotary_factor: float = 1.0  # Phi-4-mini: RoPE on the first part of each head only
    rope_local_theta: float | None = None  # Gemma 3: the windowed layers' RoPE base (unscaled)
    query_pre_attn_scalar: float | None = None  # Gemma 3: the attention scale is its -1/2 power
    final_softcap: float | None = None  # logits = c * tanh(logits / c) (Gemma 3's configs: None)
    # Mixture of experts (Qwen3-MoE): each token's MLP is its top_k of n_experts routed experts
    n_experts: int = 0  # 0: every layer's MLP is dense
    top_k: int = 0
    norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum to 1
    moe_intermediate_size: int = 0  # each expert's hidden width
    dense_layers: tuple[int, ...] = ()  # layers of a MoE model with a dense MLP instead
    # gpt-oss's variant: biases on the router and the experts; the top k of the router's
    # logits, then a softmax over them ("topk_softmax"; Qwen3-MoE: "softmax_topk"); each
    # expert's SwiGLU clamped (gate <= limit, |up| <= limit): (up + 1) * gate * sigmoid(alpha
    # * gate)
    moe_bias: bool = False
    routing: str = "softmax_topk"
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # gpt-oss: a learned logit per query head in every softmax's denominator (the sink takes
    # probability mass and gives no value)
    attn_sinks: bool = False

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}")

    @property
    def spec(self) -> Family:
        return FAMILIES[self.family]

    def is_moe_layer(self, i: int) -> bool:
        return self.n_experts > 0 and i not in self.dense_layers

    @property
    def attn_scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: it attends to every key)."""
        return None if layer in self.full_layers else self.sliding_window

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def max_context(self) -> int:
        """Most tokens a conversation may hold. A family whose reader knows which layers slide
        (`Family.exact_window`: every family with a window today) runs past it, each layer
        attending within its own; one that did not would stop at the window (up to there
        windowed attention is full attention). LongRoPE stops at its original length: past it
        transformers switches every frequency to the long factors mid-conversation, while the
        keys already cached keep the short ones, a state no paged cache reproduces."""
        limit = self.max_position
        if self.sliding_window and not self.spec.exact_window:
            limit = min(limit, self.sliding_window)
        if self.rope_scaling and self.rope_scaling.get("rope_type") == "longrope":
            limit = min(limit, self.rope_scaling["original_max_position_embeddings"])
        return limit

    @staticmethod
    def from_hf(config: dict) -> ModelArgs:
        """From a transformers config.json; refuses model types and variants it cannot run."""
        return ModelArgs(**family_of(config).read_config(config))

    def to_hf(self) -> dict:
        """A transformers config dict of this family and shape (tests build the oracle from it)."""
        return self.spec.write_config(self)

    def as_dict(self) -> dict:
        return asdict(self)


# Bundled tokenizer vocabulary: dummy shapes are widened to it so any tokenized text is valid.
BUNDLED_VOCAB = 49152

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

DUMMY_SHAPES: dict[str, ModelArgs] = {
    "tiny": ModelArgs(BUNDLED_VOCAB, 256, 4, 4, 2, 64, 512, max_position=4096),
    "llama-2-7b": ModelArgs(BUNDLED_VOCAB, 4096, 32, 32, 32, 128, 11008, max_position=4096),
    # Llama 2 13B with grouped-query attention (10 KV heads), as in the paper's evaluation.
    "llama-2-13b-gqa10": ModelArgs(BUNDLED_VOCAB, 5120, 40, 40, 10, 128, 13824, max_position=16384),
    "llama-2-70b": ModelArgs(BUNDLED_VOCAB, 8192, 80, 64, 8, 128, 28672, max_position=4096),
    # The paper's main family: learned positions, LayerNorm, ReLU, full MHA, biases, tied head.
    "opt-13b": ModelArgs(
        BUNDLED_VOCAB,
        5120,
        40,
        40,
        40,
        128,
        20480,
        max_position=2048,
        tie_embeddings=True,
        family="opt",
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        hidden_act="relu",
    ),
    # Gemma 3's text models (google/gemma-3-1b-it, the text half of gemma-3-4b-it): five
    # layers in six slide (a window of 512 / 1024 tokens), the sixth attends to everything.
    "gemma-3-1b": ModelArgs(
        262144,
        1152,
        26,
        4,
        1,
        256,
        6912,
        norm_eps=1e-6,
        rope_theta=1e6,
        max_position=32768,
        tie_embeddings=True,
        family="gemma3_text",
        hidden_act="gelu_pytorch_tanh",
        sliding_window=512,
        full_layers=(5, 11, 17, 23),
        qk_norm=True,
        rope_local_theta=10000.0,
        query_pre_attn_scalar=256,
    ),
    "gemma-3-4b": ModelArgs(
        262208,
        2560,
        34,
        8,
        4,
        256,
        10240,
        norm_eps=1e-6,
        rope_theta=1e6,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        max_position=131072,
        tie_embeddings=True,
        family="gemma3_text",
        hidden_act="gelu_pytorch_tanh",
        sliding_window=1024,
        full_layers=(5, 11, 17, 23, 29),
        qk_norm=True,
        rope_local_theta=10000.0,
        query_pre_attn_scalar=256,
    ),
    # Gemma 3 12B's text model: 48 layers, every sixth global, the rest over 1024 tokens
    "gemma-3-12b": ModelArgs(
        262208,
        3840,
        48,
        16,
        8,
        256,
        15360,
        norm_eps=1e-6,
        rope_theta=1e6,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        max_position=131072,
        tie_embeddings=True,
        family="gemma3_text",
        hidden_act="gelu_pytorch_tanh",
        sliding_window=1024,
        full_layers=tuple(range(5, 48, 6)),
        qk_norm=True,
        rope_local_theta=10000.0,
        query_pre_attn_scalar=256,
    ),
    # dummy:tiny's size with Gemma 3's layers: five of six slide over 64 tokens (the tests'
    # and dry runs' sliding-window model)
    "tiny-gemma3": ModelArgs(
        BUNDLED_VOCAB,
        256,
        6,
        4,
        2,
        64,
        512,
        norm_eps=1e-6,
        max_position=4096,
        tie_embeddings=True,
        family="gemma3_text",
        hidden_act="gelu_pytorch_tanh",
        sliding_window=64,
        full_layers=(5,),
        qk_norm=True,
        rope_local_theta=10000.0,
        query_pre_attn_scalar=64,
    ),
    # Mistral 7B v0.1: every layer slides over 4096 keys (measured by bench.window_memory, retired)
    "mistral-7b": ModelArgs(
        32000,
        4096,
        32,
        32,
        8,
        128,
        14336,
        max_position=32768,
        family="mistral",
        sliding_window=4096,
    ),
    # dummy:tiny's size with Mistral's window on every layer (64 tokens): a chunk the window
    # left is needed by no layer (the tests' model whose every layer slides)
    "tiny-mistral": ModelArgs(
        BUNDLED_VOCAB, 256, 4, 4, 2, 64, 512, max_position=4096, family="mistral", sliding_window=64
    ),
    "llama-3-8b": ModelArgs(
        128256,
        4096,
        32,
        32,
        8,
        128,
        14336,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE,
        max_position=131072,
    ),
    # Qwen3-30B-A3B: 128 routed experts, 8 a token (about 3.3B of 30.5B weights active)
    "qwen3-30b-a3b": ModelArgs(
        151936,
        2048,
        48,
        32,
        4,
        128,
        6144,  # a dense layer's width: none here
        norm_eps=1e-6,
        rope_theta=1e6,
        max_position=40960,
        family="qwen3_moe",
        qk_norm=True,
        n_experts=128,
        top_k=8,
        norm_topk_prob=True,
        moe_intermediate_size=768,
    ),
    # gpt-oss-20b (openai/gpt-oss-20b, its experts dequantized): 32 experts, 4 a token, in
    # every layer; sliding (128 keys) and full layers in turn; attention sinks; YaRN
    "gpt-oss-20b": ModelArgs(
        201088,
        2880,
        24,
        64,
        8,
        64,
        2880,
        rope_theta=150000.0,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        max_position=131072,
        family="gpt_oss",
        qkv_bias=True,
        o_bias=True,
        sliding_window=128,
        full_layers=tuple(range(1, 24, 2)),
        n_experts=32,
        top_k=4,
        moe_intermediate_size=2880,
        moe_bias=True,
        routing="topk_softmax",
        swiglu_limit=7.0,
        attn_sinks=True,
    ),
    # dummy:tiny with experts (8, 2 a token) in three of its four layers: the dry runs' MoE
    "tiny-moe": ModelArgs(
        BUNDLED_VOCAB,
        256,
        4,
        4,
        2,
        64,
        512,
        family="qwen3_moe",
        qk_norm=True,
        n_experts=8,
        top_k=2,
        norm_topk_prob=True,
        moe_intermediate_size=128,
        dense_layers=(3,),
    ),
}
