"""Replies re-encoded as a thinking template renders them in history (app/turns/reencode.py),
with the bundled tokenizer and a Qwen3-shaped template: no model needed."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from app.turns.prompt import encode, render
from app.turns.reencode import reencode
from engine.model.loader import convert_bundled
from tests.app.turns import replay

THINKING = Path(__file__).resolve().parents[3] / "bench" / "samples" / "thinking.jinja"


@pytest.fixture(scope="module")
def plain():
    return AutoTokenizer.from_pretrained(convert_bundled(None))


@pytest.fixture(scope="module")
def thinking():
    tok = AutoTokenizer.from_pretrained(convert_bundled(None))
    tok.chat_template = THINKING.read_text()
    return tok


def reply_ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"] + [
        tok.convert_tokens_to_ids("<|im_end|>")
    ]


def chat(tok, replies: list[str], redo: bool) -> list[tuple[int, int]]:
    stop = {tok.convert_tokens_to_ids("<|im_end|>")}
    return replay.chat(tok, [(t, reply_ids(tok, t)) for t in replies], stop, redo)


REPLIES = [f"<think>\nStep {i}: think hard.\n</think>\n\nAnswer number {i}." for i in range(5)]


def test_a_thinking_chat_extends_its_stream_once_replies_are_reencoded(thinking):
    for context, stored in chat(thinking, REPLIES, redo=True):
        assert context == stored  # prefix-stable: only the new turn is rendered
    for context, stored in chat(thinking, REPLIES, redo=False)[1:]:
        assert context < stored  # the stream is cut back where the reply started


def test_the_reencoded_reply_is_the_visible_part(thinking):
    msgs = [{"role": "user", "content": "Hi"}]
    stream = encode(thinking, render(thinking, msgs))
    text = "<think>\nhmm\n</think>\n\nHello there."
    r = reencode(thinking, msgs, stream, 0, text, reply_ids(thinking, text), {2})
    assert r is not None
    assert thinking.decode(r.token_ids) == "Hello there.<|im_end|>"
    # the prefilled thought of the generation prompt goes too: cut where the turn opened
    assert thinking.decode(stream[: r.keep]).endswith("<|im_start|>assistant\n")
    assert "<think>" not in thinking.decode(stream[: r.keep])


def test_nothing_changes_where_the_template_renders_replies_as_generated(plain):
    msgs = [{"role": "user", "content": "Hi"}]
    stream = encode(plain, render(plain, msgs))
    text = "<think>\nhmm\n</think>\n\nHello there."
    assert reencode(plain, msgs, stream, 0, text, reply_ids(plain, text), {2}) is None
    for context, stored in chat(plain, REPLIES, redo=True):
        assert context == stored


def test_cut_replies_and_earlier_differences_stay_as_generated(thinking):
    msgs = [{"role": "user", "content": "Hi"}]
    stream = encode(thinking, render(thinking, msgs))
    text = "<think>\nhmm\n</think>\n\nHello"
    cut = thinking(text, add_special_tokens=False)["input_ids"]  # no stop token: max_tokens
    assert reencode(thinking, msgs, stream, 0, text, cut, {2}) is None
    # an earlier reply still holds its thinking: the difference is before this turn
    first = REPLIES[0]
    earlier = [*msgs, {"role": "assistant", "content": first}, {"role": "user", "content": "More"}]
    old = stream + reply_ids(thinking, first)
    rest = encode(thinking, render(thinking, earlier), len(thinking.decode(old)))
    assert thinking.decode(old) not in thinking.decode(encode(thinking, render(thinking, earlier)))
    r = reencode(
        thinking, earlier, old + rest, len(old), "Fine.", reply_ids(thinking, "Fine."), {2}
    )
    assert r is None
