"""The batched sampler: greedy rows, temperature, top-k, top-p, seeded generators, mixed rows."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import Sampler, make_generator
from engine.types import SamplingParams as SP
from tests.devices import DEVICES


def logits_of(probs: list[float], rows: int, device: str) -> torch.Tensor:
    return torch.tensor(probs).log().repeat(rows, 1).to(device)


def freqs(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).float() / len(tokens)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_and_degenerate_cuts_equal_argmax(device):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g).to(device)
    want = logits.argmax(-1).tolist()
    params = [
        SP(),
        SP(temperature=3.0, top_k=1, seed=1),
        SP(temperature=3.0, top_p=1e-6, seed=2),
        SP(temperature=2.0, top_k=1),
        SP(temperature=1e-3, seed=3),  # so cold that the top token has all the mass
        SP(temperature=5.0, top_p=1e-6, top_k=7),
    ]
    gens = [make_generator(p, device) for p in params]
    assert Sampler(device)(logits, params, gens) == want


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_draws_follow_the_softmax(device, temperature):
    p = [0.4, 0.3, 0.15, 0.1, 0.05]
    n = 40_000
    tokens = Sampler(device)(logits_of(p, n, device), [SP(temperature=temperature)] * n, [None] * n)
    want = torch.softmax(torch.tensor(p).log() / temperature, -1)
    assert torch.allclose(freqs(tokens, 5), want, atol=0.012)


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_and_top_p_draw_only_the_kept_tokens(device):
    p = [0.5, 0.3, 0.15, 0.05]
    n = 30_000
    # top_k=3: the last token never; top_p=0.7: 0.5 + 0.3 reach it, so two tokens stay
    sp_k, sp_p = SP(temperature=1.0, top_k=3), SP(temperature=1.0, top_p=0.7)
    tokens = Sampler(device)(logits_of(p, 2 * n, device), [sp_k] * n + [sp_p] * n, [None] * 2 * n)
    k, tp = freqs(tokens[:n], 4), freqs(tokens[n:], 4)
    assert k[3] == 0 and torch.allclose(k[:3], torch.tensor([0.5, 0.3, 0.15]) / 0.95, atol=0.012)
    assert tp[2] == 0 and tp[3] == 0
    assert torch.allclose(tp[:2], torch.tensor([0.625, 0.375]), atol=0.012)


def test_top_k_keeps_ties_and_masked_tokens_are_never_drawn():
    logits = torch.tensor([[2.0, 2.0, 0.0, float("-inf")]]).repeat(4000, 1)
    tokens = Sampler("cpu")(logits, [SP(temperature=1.0, top_k=1)] * 4000, [None] * 4000)
    f = freqs(tokens, 4)
    assert f[2] == 0 and f[3] == 0 and 0.45 < f[0] < 0.55


@pytest.mark.parametrize("device", DEVICES)
def test_a_seed_gives_the_same_tokens_whatever_the_batch(device):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 300, generator=g).to(device)
    sp = SP(temperature=1.5, top_p=0.95, top_k=100, seed=42)

    def draws(order: list[int], params: list[SP]) -> list[list[int]]:
        gens = [make_generator(p, device) for p in params]
        s = Sampler(device)
        out = [s(logits[order], params, gens) for _ in range(8)]
        return [[step[order.index(i)] for step in out] for i in order]

    alone = draws([2], [sp])[0]
    others = [SP(), SP(temperature=1.0), SP(temperature=0.7, seed=5), SP(temperature=2.0, top_k=3)]
    mixed = draws([4, 2, 0, 1, 3], [others[0], sp, others[1], others[2], others[3]])
    assert mixed[1] == alone
    assert draws([2], [sp])[0] == alone  # and across runs
    other_seed = draws([2], [SP(temperature=1.5, top_p=0.95, top_k=100, seed=43)])[0]
    assert other_seed != alone


def test_rows_with_different_params_in_one_batch():
    """Row r samples from its own cut: never a token another row's cut would allow only."""
    n = 3000
    p = [0.4, 0.3, 0.2, 0.1]
    params = [
        SP(),
        SP(temperature=1.0, top_k=2),
        SP(temperature=1.0, top_p=0.5),
        SP(temperature=1.0),
    ]
    tokens = Sampler("cpu")(logits_of(p, 4 * n, "cpu"), params * n, [None] * 4 * n)
    rows = [freqs(tokens[r::4], 4) for r in range(4)]
    assert rows[0][0] == 1.0
    assert rows[1][2:].sum() == 0 and rows[1][1] > 0.35
    assert rows[2][2:].sum() == 0 and rows[2][1] > 0.35  # 0.4 < 0.5: the second token stays
    assert rows[3].min() > 0.07


def test_make_generator():
    assert make_generator(SP()) is None
    assert make_generator(SP(temperature=1.0)) is None  # unseeded: the sampler's own
    g = make_generator(SP(temperature=1.0, seed=3))
    assert g is not None and g.initial_seed() == 3
