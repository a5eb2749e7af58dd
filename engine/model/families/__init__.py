"""Model families: how each transformers `model_type` maps onto the engine's decoder.

One `Family` per supported type (`base.py`) says which layers the decoder builds (norm,
positions, MLP), how a transformers config becomes `ModelArgs` fields and back, and which
checkpoint tensors make each of the decoder's own (`checkpoint.py` loads them, strictly).
"""

from __future__ import annotations

from engine.model.families.base import Family, UnsupportedModel
from engine.model.families.gemma3 import GEMMA3
from engine.model.families.gpt_oss import GPT_OSS
from engine.model.families.llama import LLAMA, MISTRAL, QWEN2, QWEN3, SMOLLM3
from engine.model.families.opt import OPT
from engine.model.families.phi3 import PHI3
from engine.model.families.qwen3_moe import QWEN3_MOE

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (LLAMA, QWEN2, MISTRAL, QWEN3, SMOLLM3, PHI3, GEMMA3, OPT, QWEN3_MOE, GPT_OSS)
}


def family_of(config: dict) -> Family:
    kind = config.get("model_type")
    if kind not in FAMILIES:
        raise UnsupportedModel(
            f"model_type {kind!r} is not supported; supported: {', '.join(FAMILIES)}"
        )
    return FAMILIES[kind]
