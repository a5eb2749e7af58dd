"""Gemma 3 270M, the optional second bundled model (the extra `gemma`): its real weights give
transformers' greedy tokens over chats that go past the 512-token window of its sliding layers,
through swaps and drops; its chat template is Gemma's. Skipped where the extra is missing,
except the error that names it."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams, Turn
from engine.model import gemma270m
from engine.model.loader import load, model_dir
from tests.engine.test_engine_equality import ticks
from tests.oracle import hf_greedy, hf_model

NAME = gemma270m.NAME
installed = pytest.mark.skipif(
    importlib.util.find_spec(gemma270m.PACKAGE) is None,
    reason="the optional extra 'gemma' (Gemma 3 270M) is not installed",
)

# Three user turns of about 200 tokens each: with 16-token replies a chat reaches 644
# tokens, so its last replies are read with the sliding layers' window (512) past its start.
TURNS = [
    "Here are my notes on the history of the lighthouse at the end of our harbour. It was "
    "built of grey stone in the spring of a dry year, and its first keeper lit the lamp every "
    "evening at dusk, wound the clockwork that turned the lens, and wrote the weather, the "
    "ships that passed and the oil he burned into a thick ledger. ",
    "Now the second part of the story. In the winter storms the keeper's daughter rowed out "
    "twice to bring a fishing crew ashore, and the town gave her a silver medal that still "
    "hangs in the museum by the quay. Later the lamp was electrified, the clockwork stopped, "
    "and the ledger went to the archive, where I read it last summer. ",
    "Finally, the question I care about. Given everything above, how should a small town "
    "keep an old lighthouse useful today, without pretending it still guides ships, and what "
    "would you put in the museum beside the medal and the ledger? ",
]


def user_turn(tok, text: str, first: bool) -> list[int]:
    """One user turn as the chat template renders it, with the model's turn opened (a reply
    left without its <end_of_turn> is closed here, as the template closes it)."""
    body = (text * 3).strip()
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": body}], add_generation_prompt=True, tokenize=False
    )
    if not first:
        rendered = "<end_of_turn>\n" + rendered.removeprefix(tok.bos_token)
    return tok(rendered, add_special_tokens=False)["input_ids"]


@installed
@pytest.mark.slow  # a 270M model in float32 on the CPU, transformers beside it: minutes
@pytest.mark.timeout(1200)
def test_real_weights_equal_transformers_past_the_window_through_swaps_and_drops():
    # ~22 chunks a chat at its end: 24 GPU blocks hold one chat but not two, 6 CPU blocks
    # take a few of the other's, the rest is dropped and recomputed from the history.
    engine = Engine(
        EngineConfig(
            model=NAME,
            device="cpu",
            dtype="float32",
            gpu_cache_chunks=24,
            cpu_cache_chunks=6,
            max_batch_tokens=256,
        ),
        now=ticks(),
    )
    assert engine.args.sliding_window == 512 and engine.args.full_layers == (5, 11, 17)
    hf = hf_model(engine)
    tok = engine.tokenizer
    sp = SamplingParams(max_tokens=16, ignore_eos=True)  # a base model may end a turn at once
    contexts: list[list[int]] = [[], []]
    for t in range(len(TURNS)):
        prompts = [user_turn(tok, TURNS[(t + i) % 3], t == 0) for i in range(2)]
        results = engine.run([Turn(f"g{i}", p, sp) for i, p in enumerate(prompts)])
        for i, r in enumerate(results):
            contexts[i] += prompts[i]
            want = hf_greedy(hf, contexts[i], sp.max_tokens, set())
            assert r.token_ids == want, f"chat {i}, turn {t}: {r.token_ids} != {want}"
            contexts[i] += r.token_ids
        engine.cache.check()
    assert min(len(c) for c in contexts) > 512 + 100, [len(c) for c in contexts]
    counters = engine.snapshot().counters
    assert counters.swapped_in_tokens > 0, counters
    assert counters.recomputed_tokens > 0, counters
    assert counters.cached_tokens > 0, counters
    engine.close()


@installed
def test_chat_template_is_gemmas_and_prefix_stable():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir(NAME))
    chat = [
        {"role": "system", "content": "Be brief. "},
        {"role": "user", "content": " Hi! "},
        {"role": "assistant", "content": " Hello."},
        {"role": "user", "content": "Who are you?"},
    ]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n"
        "<start_of_turn>model\n Hello.<end_of_turn>\n"
        "<start_of_turn>user\nWho are you?<end_of_turn>\n<start_of_turn>model\n"
    )
    # The stream a first turn leaves (its prompt, the reply as sampled, the stop token) is a
    # prefix of the next turn's rendering: the server computes only the new turn.
    first = tok.apply_chat_template(chat[:2], add_generation_prompt=True, tokenize=False)
    stream = first + " Hello.<end_of_turn>"
    assert text.startswith(stream)
    stops = load(NAME, torch.device("cpu"), torch.float32, weights=False).stop_token_ids
    assert {tok.eos_token_id, tok.convert_tokens_to_ids("<end_of_turn>")} <= stops
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[:2] == [tok.bos_token_id, tok.convert_tokens_to_ids("<start_of_turn>")]


def test_missing_packages_name_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, gemma270m.PACKAGE, None)  # import fails, as uninstalled
    with pytest.raises(FileNotFoundError, match=r"pensieve\[gemma\]"):
        model_dir(NAME, str(tmp_path))
    assert not (tmp_path / "models" / NAME).exists()
