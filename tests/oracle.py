"""Hugging Face transformers as the oracle: the same weights, greedy, on the full context."""

from __future__ import annotations

import torch

from engine import Engine
from engine.model.loader import dummy_state, model_dir


def hf_model(engine: Engine):
    """The engine's model in transformers: a model dir as saved, a dummy shape rebuilt from
    `ModelArgs.to_hf()` (the transformers class of its family) with the same weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    name = engine.config.model
    if not name.startswith("dummy:"):
        path = model_dir(name, engine.config.cache_dir)
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = engine.args.to_hf()
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(config.pop("model_type"), **config), dtype=torch.float32
    )
    missing, unexpected = model.load_state_dict(
        dummy_state(engine.args, engine.config.seed), strict=False
    )
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
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
