"""Pages per layer group (engine/kv_layout.py): the layout of each family's shape, and a
model reading its sliding layers' KV through group tables of their own gives the logits of
one table for every layer, also with the pages that left the window freed and overwritten."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from engine.batch import StepInputs, build
from engine.kv_layout import KVLayout
from engine.kv_pool import KVPool
from engine.model.decoder import Decoder
from engine.model.shapes import DUMMY_SHAPES, ModelArgs

CS = 8


def gemma_like(window: int = 20) -> ModelArgs:
    """Six layers, 2 and 5 global: a page holds 2 layers, the 4 sliding ones fill 2 pages."""
    return ModelArgs(
        512, 64, 6, 4, 2, 16, 128, family="gemma3_text", sliding_window=window,
        full_layers=(2, 5), rope_local_theta=1e4, query_pre_attn_scalar=16, qk_norm=True,
        hidden_act="gelu_pytorch_tanh", tie_embeddings=True,
    )  # fmt: skip


def test_layouts_of_the_families():
    one = KVLayout.of(DUMMY_SHAPES["tiny"])
    assert (one.groups, one.slots, one.window) == (1, 4, None)
    g = KVLayout.of(gemma_like())
    assert g.groups == 3 and g.slots == 2 and g.window == 20
    assert g.group_of == (1, 1, 0, 2, 2, 0)
    assert g.slot_of == (0, 1, 0, 0, 1, 1)
    assert g.pages(10) == 30  # the same bytes as 10 chunks of every layer
    assert KVLayout.of(gemma_like(), savings=False).groups == 1
    b1 = KVLayout.of(DUMMY_SHAPES["gemma-3-1b"])  # 4 global, 22 sliding: the last page padded
    assert (b1.slots, b1.groups) == (4, 7)
    # a sliding layer at position p or later reads no chunk before (p - window + 1) // CS
    assert [g.first_read(p, CS) for p in (0, 19, 20, 26, 27)] == [0, 0, 0, 0, 1]


def _pages(layout: KVLayout, n_chunks: int, rng: random.Random, pages: int) -> list[list[int]]:
    """Distinct random pages for every group's chunks: [group][chunk]."""
    ids = rng.sample(range(1, pages), layout.groups * n_chunks)
    return [ids[g * n_chunks : (g + 1) * n_chunks] for g in range(layout.groups)]


def _step(model, pool, x: StepInputs) -> torch.Tensor:
    b = build(x, CS)
    return model(b.ids, b.positions, pool.layers, b.meta, b.slots, b.rows, pool.before_attention)


@pytest.mark.parametrize("seed", [0, 1])
def test_group_tables_give_the_logits_of_one_table(seed):
    torch.manual_seed(seed)
    rng = random.Random(seed)
    args = gemma_like()
    model = Decoder(args).eval()
    prompt = [rng.randrange(args.vocab_size) for _ in range(45)]
    n_chunks = -(-(len(prompt) + 1) // CS)
    # One group: every layer's KV in one block per chunk
    flat = KVPool(args, 16, 0, CS, "cpu", torch.float32)
    x = StepInputs(ids=prompt[:37], starts=[0], ends=[37], tables=[list(range(5))], sample=[0])
    want = [_step(model, flat, x)]
    x = StepInputs(ids=prompt[37:], starts=[37], ends=[45], tables=[list(range(6))], sample=[0])
    want.append(_step(model, flat, x))

    layout = KVLayout.of(args)
    pool = KVPool(args, 3 * 16, 0, CS, "cpu", torch.float32, layout=layout)
    model.set_kv_groups(layout.group_of)
    pages = _pages(layout, n_chunks, rng, 3 * 16)

    def inputs(start: int, end: int) -> StepInputs:
        n = -(-end // CS)
        return StepInputs(
            ids=prompt[start:end], starts=[start], ends=[end], tables=[pages[0][:n]],
            sample=[0], group_tables=[[p[:n] for p in pages[1:]]],
        )  # fmt: skip

    got = [_step(model, pool, inputs(0, 37))]
    # The chunks before the window of position 37 on are read by no sliding layer again:
    # their sliding pages are freed, overwritten, and the tables name page 0 (junk) instead
    gone = layout.first_read(37, CS)
    assert gone == 2
    for p in pages[1:]:
        for i in range(gone):
            pool.gpu[:, :, p[i]] = torch.randn_like(pool.gpu[:, :, p[i]]) * 100
            p[i] = 0
    got.append(_step(model, pool, inputs(37, 45)))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_the_window_matters():
    """Freeing a chunk the window still reads changes the logits (the test above can fail)."""
    torch.manual_seed(0)
    rng = random.Random(0)
    args = gemma_like()
    model = Decoder(args).eval()
    layout = KVLayout.of(args)
    model.set_kv_groups(layout.group_of)
    pool = KVPool(args, 48, 0, CS, "cpu", torch.float32, layout=layout)
    prompt = [rng.randrange(args.vocab_size) for _ in range(45)]
    pages = _pages(layout, 6, rng, 48)

    def run() -> torch.Tensor:
        x = StepInputs(
            ids=prompt[37:], starts=[37], ends=[45], tables=[pages[0]], sample=[0],
            group_tables=[[p for p in pages[1:]]],
        )  # fmt: skip
        return _step(model, pool, x)

    x = StepInputs(
        ids=prompt[:37], starts=[0], ends=[37], tables=[pages[0][:5]], sample=[0],
        group_tables=[[p[:5] for p in pages[1:]]],
    )  # fmt: skip
    _step(model, pool, x)
    before = run()
    p = pages[1][2]  # chunk 2 holds positions 16..23: position 37's window reaches 18
    pool.gpu[:, :, p] = torch.randn_like(pool.gpu[:, :, p]) * 100
    assert not torch.allclose(run(), before, atol=1e-3)


def test_no_savings_keeps_one_group():
    args = replace(gemma_like(), sliding_window=None, full_layers=())
    assert KVLayout.of(args).groups == 1
