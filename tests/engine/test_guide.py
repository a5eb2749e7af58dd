"""Constrained decoding: masks in the batched sampler, min_tokens, guided turns of the real
model, refusals at submit."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from engine import Engine, EngineConfig, Guide, SamplingParams, Turn
from engine.guide import MaskPlan, Matcher, StepMask, _ban_stops, check, plan_masks
from engine.sampler import Sampler, apply_mask, bias_of, make_generator
from engine.types import SamplingParams as SP
from tests.devices import DEVICES

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}


def unpack_bits(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    return bias_of(bits, vocab, torch.float32) == 0


def bits_of(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    """Bitmasks [rows, words] int32 with the given tokens allowed."""
    out = torch.zeros((len(allowed), (vocab + 31) // 32), dtype=torch.int64)
    for r, tokens in enumerate(allowed):
        for t in tokens:
            out[r, t // 32] |= 1 << (t % 32)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


# --- the pure parts -----------------------------------------------------------------------


def test_mask_bias_matches_each_bit():
    vocab = 100
    allowed = [[0, 31, 32, 63, 99], [], list(range(0, 100, 7))]
    got = unpack_bits(bits_of(allowed, vocab), vocab)
    assert got.shape == (3, vocab)
    for r, tokens in enumerate(allowed):
        assert got[r].nonzero().flatten().tolist() == tokens
    # a tokenizer that knows fewer tokens than the logits: the rest are not allowed
    assert unpack_bits(bits_of([[3]], 32), 70)[0].nonzero().flatten().tolist() == [3]


def test_plan_masks_guided_rows_and_min_tokens():
    m = Matcher(object())
    rows = [
        (None, 0, 0, ()),  # unconstrained
        (m, 1, 0, ()),  # guided
        (None, 2, 5, (7,)),  # under min_tokens: the model's stops and its own
        (m, 2, 3, ()),  # guided, under min_tokens
        (None, 5, 5, ()),  # min_tokens reached
    ]
    p = plan_masks(rows, (0, 2))
    assert p.guided == [(1, m, False), (3, m, True)]
    assert p.banned == [(2, (0, 2, 7))]
    assert not plan_masks([(None, 4, 2, ())], (0,)) and isinstance(p, MaskPlan)


def test_ban_stops_keeps_a_row_that_only_a_stop_would_end():
    row = bits_of([[2, 40, 63]], 64)[0]
    _ban_stops(row, (2, 63))
    assert unpack_bits(row[None], 64)[0].nonzero().flatten().tolist() == [40]
    row = bits_of([[2]], 64)[0]  # the grammar is complete: its stop stays allowed
    _ban_stops(row, (2, 63))
    assert unpack_bits(row[None], 64)[0].nonzero().flatten().tolist() == [2]


@pytest.mark.parametrize("device", DEVICES)
def test_masks_apply_to_greedy_and_sampled_rows_of_one_batch(device):
    vocab, n = 64, 400
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, vocab, generator=g)
    free = base[3].argmax().item()
    allowed = [5, 17, 40]  # rows 0 (greedy) and 1 (sampled) are guided
    params = [SP(), SP(temperature=1.0, seed=1), SP(temperature=1.0, top_k=3, seed=2), SP()]
    sampler = Sampler(device)
    gens = [make_generator(p, device) for p in params]
    seen = set()
    for _ in range(n):
        logits = base.clone().to(device)
        mask = StepMask([0, 1], bits_of([allowed, allowed], vocab), [(2, (0, 1, 2))])
        out = sampler(logits, params, gens, mask)
        assert out[0] == max(allowed, key=lambda t: base[0, t].item())
        assert out[1] in allowed
        assert out[2] not in (0, 1, 2)
        assert out[3] == free  # the unconstrained row is untouched
        seen.add(out[1])
    assert seen == set(allowed)  # sampled, not just the row's argmax


def test_apply_mask_of_all_rows_and_bans_only():
    logits = torch.zeros(2, 40)
    apply_mask(logits, StepMask([0, 1], bits_of([[1], [2, 3]], 40), []))
    assert torch.isfinite(logits).nonzero().tolist() == [[0, 1], [1, 2], [1, 3]]
    logits = torch.zeros(2, 40)
    apply_mask(logits, StepMask([], None, [(1, (4, 5))]))
    assert torch.isinf(logits).nonzero().tolist() == [[1, 4], [1, 5]]


@pytest.mark.parametrize(
    "guide, message",
    [
        (Guide("json_schema", "{not json"), "not valid JSON"),
        (Guide("json_schema", "[1, 2]"), "JSON object"),
        (Guide("json_schema", '{"type": "nope"}'), "nope"),
        (Guide("json_schema", '{"$ref": "#/defs/x"}'), "does not exist"),
        (Guide("regex", "a{2,"), "regex"),
        (Guide("lark", "start: missing"), "missing"),
        (Guide("regex", ""), "non-empty"),
    ],
)
def test_check_refuses_bad_guides(guide, message):
    pytest.importorskip("llguidance")
    with pytest.raises(ValueError, match=message):
        check(guide)


def test_without_llguidance_a_guide_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # as where it is not installed
    with pytest.raises(ValueError, match="needs the llguidance package"):
        check(Guide("json_object"))


# --- guided turns of the bundled model ------------------------------------------------------


@pytest.fixture(scope="module")
def smol() -> Engine:
    pytest.importorskip("llguidance")  # an optional dependency (a bare GPU machine lacks it)
    engine = Engine(EngineConfig(model="smollm2-135m-instruct", device="cpu", gpu_cache_chunks=64))
    yield engine
    engine.close()


def chat(engine: Engine, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    return engine.tokenizer.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def text_of(engine: Engine, ids: list[int]) -> str:
    return engine.tokenizer.decode([t for t in ids if t not in engine.stop_token_ids])


def test_guided_turns_match_their_grammar_and_leave_others_alone(smol):
    jsonschema = pytest.importorskip("jsonschema")
    prompt = chat(smol, "Describe a person as JSON.")
    other = chat(smol, "Say hi.")
    alone = smol.run([Turn("alone", other, SP(max_tokens=12))])[0]
    person = Guide("json_schema", json.dumps(PERSON))
    results = smol.run(
        [
            Turn("g0", prompt, SP(max_tokens=40, guide=person)),
            Turn("g1", prompt, SP(max_tokens=40, guide=person, temperature=0.9, seed=5)),
            Turn("free", other, SP(max_tokens=12)),
            Turn("rx", prompt, SP(max_tokens=10, guide=Guide("regex", r"(yes|no)\.[0-9]{2}"))),
            Turn("lark", prompt, SP(max_tokens=10, guide=Guide("lark", 'start: "a" ("b" | "c")+'))),
        ]
    )
    for r in results[:2]:
        assert r.finish_reason == "stop" and r.token_ids[-1] in smol.stop_token_ids
        jsonschema.validate(json.loads(text_of(smol, r.token_ids)), PERSON)
    assert results[2].token_ids == alone.token_ids  # an unguided row is not disturbed
    rx = text_of(smol, results[3].token_ids)
    assert results[3].finish_reason == "stop" and rx[:-2] in ("yes.", "no.") and rx[-2:].isdigit()
    lark = text_of(smol, results[4].token_ids)
    assert lark[0] == "a" and set(lark[1:]) <= {"b", "c"}
    assert all(r.guide is None for r in smol.scheduler.running)  # matchers are freed


def test_min_tokens_keeps_the_stop_token_back(smol):
    prompt = chat(smol, "Say hi.")
    free = smol.run([Turn("m0", prompt, SP(max_tokens=64))])[0]
    assert free.finish_reason == "stop"
    n = len(free.token_ids) + 4
    held = smol.run([Turn("m1", prompt, SP(max_tokens=n + 8, min_tokens=n))])[0]
    assert len(held.token_ids) >= n
    assert not set(held.token_ids[: n - 1]) & set(smol.stop_token_ids)
    assert held.token_ids[: len(free.token_ids) - 1] == free.token_ids[:-1]


def test_bad_guides_are_refused_at_submit(smol):
    for sp in (
        SP(guide=Guide("json_schema", '{"type": 5}')),
        SP(guide=Guide("regex", "(")),
        SP(guide=Guide("json_object"), ignore_eos=True),
    ):
        with pytest.raises(ValueError):
            smol.submit(Turn("bad", [1, 2], sp))
        assert "bad" not in smol.streams


def test_a_cancelled_guided_turn_frees_its_matcher(smol):
    req = smol.submit(
        Turn("c", chat(smol, "JSON please"), SP(max_tokens=30, guide=Guide("json_object")))
    )
    smol.step()
    assert req.guide is not None
    smol.cancel(req)
    ended = smol.step()
    assert req in ended and req.guide is None and req.result().finish_reason == "cancelled"


def test_simulated_device_refuses_guides():
    engine = Engine(EngineConfig(model="dummy:tiny", device="sim:h100"))
    with pytest.raises(ValueError, match="simulated"):
        engine.submit(Turn("s", [1, 2], SamplingParams(guide=Guide("json_object"))))
