"""Units of the app: frame validation, turn deltas, incremental detokenization, settings."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from app.chat import BadFrame, parse_message
from app.detok import Detokenizer
from app.prompt import chat_messages, common_prefix, render_delta
from app.settings import Settings
from engine.loader import convert_bundled


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(convert_bundled(None))


def ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False).input_ids)


# --- frames -----------------------------------------------------------------------------


def test_parse_message_defaults_and_limits():
    req = parse_message({"type": "message", "content": "hi"}, 100, 64, 512)
    assert req.content == "hi" and req.sampling.max_tokens == 64 and not req.max_tokens_given
    assert req.sampling.temperature == 0.0 and req.sampling.top_p == 1.0
    req = parse_message(
        {"content": "hi", "max_tokens": 9, "temperature": 0.7, "top_p": 0.9, "seed": 3},
        100,
        64,
        512,
    )
    assert (
        req.sampling.max_tokens,
        req.sampling.temperature,
        req.sampling.top_p,
        req.sampling.seed,
    ) == (9, 0.7, 0.9, 3)
    assert req.max_tokens_given


@pytest.mark.parametrize(
    "frame, code",
    [
        ({}, "bad_content"),
        ({"content": ""}, "bad_content"),
        ({"content": ["x"]}, "bad_content"),
        ({"content": "x" * 101}, "too_long"),
        ({"content": "x", "max_tokens": 513}, "bad_sampling"),
        ({"content": "x", "max_tokens": 2.0}, "bad_sampling"),
        ({"content": "x", "temperature": float("nan")}, "bad_sampling"),
        ({"content": "x", "temperature": 2.5}, "bad_sampling"),
        ({"content": "x", "top_p": 1.5}, "bad_sampling"),
        ({"content": "x", "top_p": False}, "bad_sampling"),
        ({"content": "x", "seed": -1}, "bad_sampling"),
    ],
)
def test_parse_message_refuses(frame, code):
    with pytest.raises(BadFrame) as e:
        parse_message(frame, 100, 64, 512)
    assert e.value.code == code and str(e.value)


def test_settings_from_env(monkeypatch):
    monkeypatch.setenv("PENSIEVE_ALLOWED_ORIGINS", "https://a.example/, https://b.example")
    monkeypatch.setenv("PENSIEVE_GPU_CACHE_CHUNKS", "7")
    s = Settings(port=9000)
    assert s.allowed_origins == ["https://a.example", "https://b.example"]
    assert s.gpu_cache_chunks == 7 and s.port == 9000
    assert s.engine_config().gpu_cache_chunks == 7
    monkeypatch.setenv("PENSIEVE_CACHE_MODE", "nonsense")
    with pytest.raises(ValueError, match="cache_mode"):
        Settings().engine_config()


# --- deltas -----------------------------------------------------------------------------


def test_delta_extends_the_stored_stream(tok):
    first = render_delta(tok, chat_messages("Be brief.", [], "Hi"), [])
    assert first.context_len == 0
    assert tok.decode(first.token_ids).startswith("<|im_start|>system\nBe brief.")
    reply = ids(tok, "Hello there!") + [tok.convert_tokens_to_ids("<|im_end|>")]
    stored = first.token_ids + reply
    msgs = chat_messages("Be brief.", [("user", "Hi"), ("assistant", "Hello there!")], "Again")
    second = render_delta(tok, msgs, stored)
    assert second.context_len == len(stored)
    full = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert tok.decode(stored + second.token_ids) == full
    assert (
        tok.decode(second.token_ids)
        == "\n<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n"
    )


def test_cancelled_reply_without_end_token_is_closed_by_the_delta(tok):
    first = render_delta(tok, chat_messages(None, [], "Hi"), [])
    stored = first.token_ids + ids(tok, "Once upon")  # stopped mid-reply: no <|im_end|>
    msgs = chat_messages(None, [("user", "Hi"), ("assistant", "Once upon")], "Go on")
    d = render_delta(tok, msgs, stored)
    assert d.context_len == len(stored)
    assert tok.decode(d.token_ids).startswith("<|im_end|>\n<|im_start|>user\nGo on")


def test_template_that_is_not_prefix_stable_keeps_the_common_prefix():
    tok = AutoTokenizer.from_pretrained(convert_bundled(None))
    # A template that trims messages re-renders an earlier reply differently.
    tok.chat_template = tok.chat_template.replace("message['content']", "message['content'] | trim")
    first = render_delta(tok, chat_messages("S", [], "Hi"), [])
    end = tok.convert_tokens_to_ids("<|im_end|>")
    stored = first.token_ids + ids(tok, "Hello   \n\n") + [end]
    msgs = chat_messages("S", [("user", "Hi"), ("assistant", "Hello   \n\n")], "More")
    d = render_delta(tok, msgs, stored)
    full_ids = ids(tok, tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
    assert d.context_len < len(stored)
    assert d.context_len == common_prefix(full_ids, stored)
    assert stored[: d.context_len] + d.token_ids == full_ids  # exactly what the model will see


# --- detokenization ---------------------------------------------------------------------


@pytest.mark.parametrize("text", ["Plain words, and more.", "Grüße 日本語 🙂 naïve — ok", "🙂🙂"])
def test_detokenizer_never_splits_a_character(tok, text):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    token_ids = ids(tok, text) + [end]
    detok = Detokenizer(tok, {end})
    pieces = [detok.push(t) for t in token_ids] + [detok.flush()]
    assert "".join(pieces) == text == detok.text()
    assert not any("\ufffd" in p for p in pieces)
    if text == "🙂🙂":  # one emoji spans several byte tokens: nothing shows until it is whole
        assert len(ids(tok, "🙂")) > 1 and pieces[0] == ""


def test_detokenizer_flushes_an_incomplete_character(tok):
    partial = ids(tok, "🙂")[:-1]
    detok = Detokenizer(tok)
    assert "".join(detok.push(t) for t in partial) == ""
    out = detok.flush()
    assert out and set(out) == {"\ufffd"}
