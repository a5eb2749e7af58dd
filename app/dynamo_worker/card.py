"""The model dir Dynamo's frontend reads (its "model deployment card"): the frontend
tokenizes and applies the chat template itself, from the model's own files.

Pensieve's converted bundled model has `"architectures": null` in config.json, which the
frontend cannot parse ("invalid type: unit value, expected a sequence"), so the card is a
dir of links to the model's tokenizer files and a config.json with the field filled in."""

from __future__ import annotations

import json
from pathlib import Path

from engine.model.loader import cache_root, model_dir

FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
)


def card_dir(model: str, cache_dir: str | None = None) -> Path:
    """A dir for `register_model`: the model's own when its config.json names its
    architectures, else links and a fixed config.json under the cache."""
    src = model_dir(model, cache_dir)
    config = json.loads((src / "config.json").read_text())
    if config.get("architectures"):
        return src
    out = cache_root(cache_dir) / "dynamo-cards" / src.name
    out.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        link = out / name
        if (src / name).exists() and not link.exists():
            link.symlink_to(src / name)
    # any name will do: the frontend only needs a list (it never loads the weights)
    arch = {"llama": "LlamaForCausalLM"}.get(config.get("model_type", ""), "CausalLM")
    config["architectures"] = [arch]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
