"""Model shape: the config dataclass every loader produces, and the named dummy shapes."""

from __future__ import annotations

from dataclasses import asdict, dataclass


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
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear", "factor": ..., ...}
    max_position: int = 4096
    tie_embeddings: bool = False

    @staticmethod
    def from_hf(config: dict) -> ModelArgs:
        heads = config["num_attention_heads"]
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        return ModelArgs(
            vocab_size=config["vocab_size"],
            dim=config["hidden_size"],
            n_layers=config["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate_size=config["intermediate_size"],
            norm_eps=config.get("rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position=config.get("max_position_embeddings", 4096),
            tie_embeddings=config.get("tie_word_embeddings", False),
        )

    def to_hf(self) -> dict:
        """A transformers LlamaConfig dict of the same shape (tests compare against it)."""
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta}
        return {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
        }

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
}
