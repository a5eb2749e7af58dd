"""The conversations a benchmark replays: a committed tokenized sample (no tokenizer or
dataset needed), or a fresh draw from ShareGPT tokenized with the model's tokenizer."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.lib import workload as wl
from bench.lib.presets import Preset
from engine.model.loader import BUNDLED, model_dir


def load_tokenizer(model: str):
    """The tokenizer of the model the server runs (the sample's token counts depend on it)."""
    from transformers import AutoTokenizer  # seconds to import: only where a sample is drawn

    if model.startswith("dummy:"):  # dummy shapes use the bundled tokenizer
        model = BUNDLED
    return AutoTokenizer.from_pretrained(model_dir(model))


def save_sample(path: Path, convs: list[wl.Conversation], workload: dict[str, Any]) -> None:
    """The tokenized sample as JSON: a machine without the dataset package replays it as is."""
    data = {"workload": workload, "conversations": [asdict(c) for c in convs]}
    path.write_text(json.dumps(data))


def read_sample(path: Path) -> tuple[list[wl.Conversation], dict[str, Any]]:
    data = json.loads(path.read_text())
    convs = [
        wl.Conversation(c["id"], [wl.TurnSpec(**t) for t in c["turns"]])
        for c in data["conversations"]
    ]
    return convs, {**data["workload"], "sample_file": path.name}


def load_workload(preset: Preset, max_context: int | None, sample_file=None):
    """The preset's sample: replayed from `sample_file` when it exists (no tokenizer or
    dataset needed, as on a bare GPU machine), else drawn from ShareGPT and tokenized."""
    if sample_file is not None and Path(sample_file).exists():
        convs, info = read_sample(Path(sample_file))
        if preset.conversations < len(convs):  # a quick check on the first few
            convs = convs[: preset.conversations]
        if preset.dry:
            convs = wl.shorten(convs, prompt=40, output=6, turns=3)
        return convs, {**info, "summary": wl.summarize(convs)}
    tokenizer = load_tokenizer(preset.model)
    data = wl.load_sharegpt(tokenizer)
    cap = min(preset.context_cap, max_context or preset.context_cap)
    convs = wl.sample(
        data.conversations,
        preset.conversations,
        preset.seed,
        context_cap=cap,
        max_output=preset.max_output,
        min_turns=preset.min_turns,
        max_turns=preset.max_turns,
        min_context=preset.min_context,
    )
    return convs, {
        "source": data.source,
        "parse": asdict(data.report),
        "tokenizer": wl.tokenizer_name(tokenizer),
        "context_cap": cap,
        "summary": wl.summarize(convs),
    }
