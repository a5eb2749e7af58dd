"""Harmony replies (gpt-oss, app/turns/harmony.py): only the final channel is the answer,
and a chat whose template drops earlier replies' analysis extends its stream turn after
turn once each reply is re-encoded. The bundled tokenizer given harmony's special tokens and
a harmony-shaped template (bench/samples/harmony.jinja): no model needed."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from app.turns import harmony
from app.turns.detok import Detokenizer
from app.turns.prompt import encode, render
from app.turns.reencode import reencode
from engine.model.loader import convert_bundled
from tests.app.turns import replay

TEMPLATE = Path(__file__).resolve().parents[3] / "bench" / "samples" / "harmony.jinja"
SPECIALS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"]


@pytest.fixture(scope="module")
def tok():
    t = AutoTokenizer.from_pretrained(convert_bundled(None))
    t.add_special_tokens({"additional_special_tokens": SPECIALS})
    t.chat_template = TEMPLATE.read_text()
    return t


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def reply(i: int) -> str:
    return (
        f"<|channel|>analysis<|message|>Step {i}: the user wants a number.<|end|>"
        f"<|start|>assistant<|channel|>final<|message|>Answer number {i}.<|return|>"
    )


def shown(tok, token_ids: list[int]) -> tuple[str, str]:
    """What streams to the user, and the reply's text."""
    detok = Detokenizer(tok, set(), harmony.channels(tok))
    pieces = "".join(detok.push(t) for t in token_ids) + detok.flush()
    return pieces, detok.text()


def test_only_the_final_channel_is_shown(tok):
    assert shown(tok, ids(tok, reply(3))) == ("Answer number 3.", "Answer number 3.")
    two = "<|channel|>commentary<|message|>Looking it up.<|end|><|start|>assistant"
    two += "<|channel|>final<|message|>Found: 42.<|end|>"
    assert shown(tok, ids(tok, two))[0] == "Found: 42."


def test_a_reply_that_never_opens_a_message_is_shown_as_written(tok):
    assert shown(tok, ids(tok, "Just text."))[0] == "Just text."


def test_a_tokenizer_without_the_format_routes_nothing(tok):
    plain = AutoTokenizer.from_pretrained(convert_bundled(None))
    assert harmony.channels(plain) is None and harmony.message_ends(plain) == frozenset()
    assert harmony.message_ends(tok) == {tok.convert_tokens_to_ids(t) for t in SPECIALS[3:]}


def chat(tok, turns: int, redo: bool) -> list[tuple[int, int]]:
    stop = {tok.convert_tokens_to_ids("<|return|>")}
    replies = []
    for i in range(turns):
        out = ids(tok, reply(i))
        replies.append((shown(tok, out)[1], out))  # the text stored: the final channel
    return replay.chat(tok, replies, stop, redo)


def test_a_harmony_chat_extends_its_stream_once_replies_are_reencoded(tok):
    for context, stored in chat(tok, 5, redo=True):
        assert context == stored  # prefix-stable: only the new turn is rendered
    for context, stored in chat(tok, 5, redo=False)[1:]:
        assert context < stored  # cut back where the last reply's analysis began


def test_the_reencoded_reply_is_its_final_message(tok):
    msgs = [{"role": "user", "content": "Hi"}]
    stream = encode(tok, render(tok, msgs))
    out = ids(tok, reply(0))
    r = reencode(tok, msgs, stream, 0, "Answer number 0.", out, {out[-1]})
    assert r is not None
    assert r.keep == len(stream)  # the whole prompt stays, through the generation prompt
    redone = tok.decode(r.token_ids, skip_special_tokens=False)
    assert redone == "<|channel|>final<|message|>Answer number 0.<|end|>"
