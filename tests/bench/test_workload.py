"""The multi-turn workload: ShareGPT parsing, tokenization, caps, arrivals and replay order."""

from __future__ import annotations

import asyncio
import io
import json
import random
import statistics
import time

import pytest

from bench.lib import workload as w

# ---------------------------------------------------------------- parser


def _conv(cid: str, *pairs: tuple[str, str]) -> dict:
    return {"id": cid, "conversations": [{"from": f, "value": v} for f, v in pairs]}


GOOD = _conv("a", ("human", "héllo ✓"), ("gpt", "hi"), ("human", "more"), ("gpt", "sure"))
TRAILING = _conv("b", ("human", "q"), ("gpt", "a"), ("human", "unanswered"))
NOT_ALT = _conv("c", ("human", "q"), ("human", "q2"), ("gpt", "a"))
GPT_FIRST = _conv("d", ("gpt", "a"), ("human", "q"))
UNKNOWN = _conv("e", ("human", "q"), ("bing", "a"))
EMPTY = _conv("f")


def _truncated_file() -> bytes:
    items = [GOOD, TRAILING, NOT_ALT, GPT_FIRST, UNKNOWN, EMPTY, "not an object", GOOD]
    text = "[\n" + ",\n".join(json.dumps(i, ensure_ascii=False, indent=1) for i in items)
    tail = ',\n {"id": "cut", "conversations": [{"from": "human", "value": "this is cut sh'
    return (text + tail).encode()


@pytest.mark.parametrize("chunk", [3, 7, 64, 1 << 20])
def test_parser_keeps_complete_elements_of_truncated_file(chunk: int) -> None:
    report = w.ParseReport()
    items = list(w.iter_json_array(io.BytesIO(_truncated_file()), report, chunk=chunk))
    assert report.complete == 8
    assert report.truncated
    assert items[0] == GOOD  # multi-byte characters split across chunks decode intact
    assert items[-1] == GOOD and len(items) == 8


def test_parser_reports_malformed_conversations() -> None:
    convs, report = w.parse_sharegpt(io.BytesIO(_truncated_file()))
    assert [c[0] for c in convs] == ["a", "b", "a"]
    assert report.complete == 8 and report.valid == 3 and report.truncated
    assert report.malformed == {
        "not alternating": 2,
        "unknown role": 1,
        "no exchange": 1,
        "not a conversation object": 1,
    }
    # The unanswered last message of "b" is dropped; roles are mapped to the template's.
    assert convs[1][1] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


def test_parser_complete_file_and_bad_input() -> None:
    data = json.dumps([GOOD, GOOD]).encode()
    report = w.ParseReport()
    assert len(list(w.iter_json_array(io.BytesIO(data), report, chunk=5))) == 2
    assert not report.truncated and report.complete == 2
    with pytest.raises(ValueError, match="expected a JSON array"):
        list(w.iter_json_array(io.BytesIO(b'{"a": 1}'), w.ParseReport()))


# ---------------------------------------------------------------- tokenization


TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [
        "user",
        "assistant",
        "hello",
        "hi",
        "there",
        "how",
        "are",
        "you",
        "fine",
        "thanks",
        "bye",
        "ok",
    ]
    vocab = {w_: i for i, w_ in enumerate(["<unk>", "<|im_start|>", "<|im_end|>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = TEMPLATE
    return fast


MESSAGES = [
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "hi there how are you"},
    {"role": "user", "content": "fine thanks"},
    {"role": "assistant", "content": "ok bye"},
]


def test_deltas_rebuild_the_template_stream(tokenizer) -> None:
    conv = w.tokenize_conversation(tokenizer, "x", MESSAGES)
    assert conv is not None
    assert [t.output_len for t in conv.turns] == [5, 2]
    stream = []
    for spec, msg in zip(conv.turns, MESSAGES[1::2], strict=True):
        stream += spec.prompt + tokenizer(msg["content"], add_special_tokens=False)["input_ids"]
    full = tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    # Only the close of the last reply is never sent.
    assert stream + [2] == tokenizer(full, add_special_tokens=False)["input_ids"]
    # The second delta closes the first reply, then opens the next user message.
    assert tokenizer.convert_ids_to_tokens(conv.turns[1].prompt[:2]) == [
        "<|im_end|>",
        "<|im_start|>",
    ]
    assert conv.context_lens() == [len(conv.turns[0].prompt) + 5, len(stream)]


def test_load_sharegpt_caches_by_file_and_tokenizer(tmp_path, monkeypatch, tokenizer) -> None:
    monkeypatch.setenv("PENSIEVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "data.json"
    good = _conv("g", ("human", "hello"), ("gpt", "hi there"))
    path.write_text(json.dumps([good, NOT_ALT])[:-1])  # cut off the closing bracket
    first = w.load_sharegpt(tokenizer, path)
    assert [c.id for c in first.conversations] == ["g"]
    assert first.report.valid == 1 and first.report.malformed == {"not alternating": 1}
    assert len(list((tmp_path / "cache" / "workload").glob("*.pkl"))) == 1
    path.write_text(json.dumps([good, good, NOT_ALT]))  # new size: a new cache entry
    assert len(w.load_sharegpt(tokenizer, path).conversations) == 2
    assert len(list((tmp_path / "cache" / "workload").glob("*.pkl"))) == 2


# ---------------------------------------------------------------- caps and summary


def _spec_conv(cid: str, shape: list[tuple[int, int]]) -> w.Conversation:
    return w.Conversation(cid, [w.TurnSpec(list(range(p)), o) for p, o in shape])


def test_context_cap_drops_turns_beyond_it() -> None:
    conv = _spec_conv("c", [(100, 50), (10, 300), (20, 20)])
    capped = w.cap_conversation(conv, context_cap=400, max_output=1000)
    assert [t.output_len for t in capped.turns] == [50]  # 460 > 400 after turn 2
    capped = w.cap_conversation(conv, context_cap=400, max_output=100)
    assert [t.output_len for t in capped.turns] == [50, 100, 20]
    assert capped.context_lens() == [150, 260, 300]
    assert w.cap_conversation(conv, context_cap=120, max_output=1000) is None
    assert all(c.context_lens()[-1] <= 500 for c in w.sample([conv] * 3, 3, 0, context_cap=500))
    with pytest.raises(ValueError, match="only 0 conversations"):
        w.sample([conv], 1, 0, context_cap=100)


def test_summary_table() -> None:
    convs = [_spec_conv("a", [(10, 20), (30, 40)]), _spec_conv("b", [(5, 5), (5, 5), (5, 5)])]
    s = w.summarize(convs)
    assert s["conversations"] == 2 and s["turns"] == 5
    assert s["turns_per_conversation"] == {"mean": 2.5, "p50": 2.5, "p90": 2.9, "max": 3.0}
    assert s["input_tokens_per_turn"]["mean"] == pytest.approx(11.0)
    assert s["output_tokens_per_turn"]["max"] == 40.0
    assert s["context_length"]["mean"] == pytest.approx(65.0)  # (100 + 30) / 2
    table = w.format_summary(s)
    assert "Context length" in table and "mean 65.0" in table and "Conversations" in table


# ---------------------------------------------------------------- arrivals


def test_poisson_arrivals_statistics_and_seed() -> None:
    rate, n = 2.0, 40_000
    times = w.poisson_arrivals(rate, n, seed=1)
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.03)
    assert statistics.pvariance(gaps) == pytest.approx(1 / rate**2, rel=0.06)
    assert times == sorted(times)
    assert w.poisson_arrivals(rate, 10, seed=1) == times[:10]
    assert w.poisson_arrivals(rate, 10, seed=2) != times[:10]
    with pytest.raises(ValueError):
        w.poisson_arrivals(0.0, 3, seed=1)


def test_think_times_are_per_conversation_and_seeded() -> None:
    think = w.think_times(60.0, 20_000, seed=3, key="c")
    assert statistics.fmean(think) == pytest.approx(60.0, rel=0.03)
    assert w.think_times(60.0, 5, seed=3, key="c") == think[:5]
    assert w.think_times(60.0, 5, seed=3, key="d") != think[:5]
    assert w.think_times(0.0, 2, seed=3, key="c") == [0.0, 0.0]
    convs = [_spec_conv(str(i), [(4, 4)] * (i + 1)) for i in range(4)]
    plans = w.plan(convs, rate=1.0, think_mean=5.0, seed=9)
    assert [len(p.think_s) for p in plans] == [0, 1, 2, 3]
    assert [p.think_s for p in plans] == [p.think_s for p in w.plan(convs, 1.0, 5.0, seed=9)]


def test_replay_sends_a_turn_only_after_the_previous_reply() -> None:
    convs = [_spec_conv(f"c{i}", [(3, 2)] * (1 + i % 4)) for i in range(12)]
    plans = w.plan(convs, rate=400.0, think_mean=0.004, seed=5)
    rng = random.Random(0)
    in_flight: set[str] = set()
    log: list[tuple[str, int]] = []

    async def send(cid: str, index: int, spec: w.TurnSpec, context: int) -> w.Reply:
        assert cid not in in_flight, "two turns of one conversation in flight"
        in_flight.add(cid)
        log.append((cid, index))
        await asyncio.sleep(rng.uniform(0.0, 0.01))  # a reply takes a while
        first = time.monotonic()
        await asyncio.sleep(rng.uniform(0.0, 0.005))
        in_flight.discard(cid)
        return w.Reply(
            first_token_at=first, done_at=time.monotonic(), output_tokens=spec.output_len
        )

    records = asyncio.run(w.replay(plans, send))
    assert len(records) == sum(len(c.turns) for c in convs)
    by_conv: dict[str, list[w.TurnRecord]] = {}
    for r in records:
        by_conv.setdefault(r.conversation, []).append(r)
    for p in plans:
        recs = by_conv[p.conversation.id]
        assert [r.index for r in recs] == list(range(len(p.conversation.turns)))
        assert recs[0].sent_s >= p.arrival_s - 1e-3
        for prev, nxt, think in zip(recs, recs[1:], p.think_s, strict=False):
            assert nxt.sent_s >= prev.done_s + think - 1e-3
            assert nxt.context_tokens == prev.context_tokens + 3 + 2
        assert all(r.latency_s >= r.ttft_s >= 0 for r in recs)
    assert [i for c, i in log if c == "c3"] == [0, 1, 2, 3]


def test_replay_time_scale_and_stop_on_error() -> None:
    conv = _spec_conv("x", [(2, 2)] * 3)
    p = w.Plan(conv, arrival_s=1.0, think_s=[2.0, 2.0])
    now = [0.0]
    slept: list[float] = []

    async def sleep(d: float) -> None:
        slept.append(d)
        now[0] += d

    async def send(cid, index, spec, context) -> w.Reply:
        now[0] += 0.5
        return w.Reply(now[0], now[0], 2, error="boom" if index == 1 else None)

    recs = asyncio.run(w.replay([p], send, time_scale=0.1, clock=lambda: now[0], sleep=sleep))
    assert slept == pytest.approx([0.1, 0.2])  # the third turn is never sent after an error
    assert [r.index for r in recs] == [0, 1] and recs[1].error == "boom"
    assert recs[1].sent_s == pytest.approx(0.1 + 0.5 + 0.2)


def test_typing_hints_come_their_lead_before_each_later_turn() -> None:
    """`Plan.lead_s` (typing-aware prefetch, `bench.serve --typing`): the user starts typing
    that long before sending; told only where the replay is given `typing`."""
    conv = _spec_conv("x", [(2, 2)] * 3)
    p = w.Plan(conv, arrival_s=1.0, think_s=[2.0, 3.0], lead_s=[0.5, 9.0])
    now = [0.0]
    events: list[tuple] = []

    async def sleep(d: float) -> None:
        events.append(("wait", d))
        now[0] += d

    async def send(cid, index, spec, context) -> w.Reply:
        events.append(("send", index))
        return w.Reply(now[0], now[0], 2)

    def typing(cid: str) -> None:
        events.append(("typing", cid))

    asyncio.run(w.replay([p], send, clock=lambda: now[0], sleep=sleep, typing=typing))
    # a lead longer than the think time: typing starts as the reply ends
    assert events == [("wait", 1.0), ("send", 0), ("wait", 1.5), ("typing", "x"),
                      ("wait", 0.5), ("send", 1), ("typing", "x"), ("wait", 3.0),
                      ("send", 2)]  # fmt: skip
    events.clear()
    now[0] = 0.0
    asyncio.run(w.replay([p], send, clock=lambda: now[0], sleep=sleep))  # hints off
    assert [e for e in events if e[0] != "wait"] == [("send", 0), ("send", 1), ("send", 2)]
    assert sum(d for kind, d in events if kind == "wait") == pytest.approx(1.0 + 2.0 + 3.0)
