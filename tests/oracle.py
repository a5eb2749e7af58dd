"""Hugging Face transformers as the oracle: the same weights, greedy, on the full context."""

from __future__ import annotations

import torch

from engine import Engine
from engine.loader import BUNDLED, convert_bundled, dummy_state


def hf_model(engine: Engine):
    from transformers import LlamaConfig, LlamaForCausalLM

    name = engine.config.model
    if name == BUNDLED:
        model = LlamaForCausalLM.from_pretrained(
            convert_bundled(engine.config.cache_dir), dtype=torch.float32
        )
    else:
        config = LlamaConfig(**engine.args.to_hf())
        model = LlamaForCausalLM(config)
        state = dummy_state(engine.args, engine.config.seed)
        model.load_state_dict(state, strict=False)
        if engine.args.tie_embeddings:
            model.tie_weights()
    return model.eval()


@torch.inference_mode()
def hf_greedy(model, context: list[int], max_new: int, stop: set[int], device="cpu") -> list[int]:
    """Greedy continuation with the model's own KV cache; includes the stop token if hit."""
    ids = torch.tensor([context], device=device)
    out = model(input_ids=ids, use_cache=True)
    past, tokens = out.past_key_values, []
    for _ in range(max_new):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        if token in stop:
            break
        out = model(
            input_ids=torch.tensor([[token]], device=device), past_key_values=past, use_cache=True
        )
        past = out.past_key_values
    return tokens
