"""A step's tensors built by tensor ops equal the per-token definition."""

from __future__ import annotations

import random

import pytest
import torch

from engine.batch import StepInputs, build
from kernels import AttentionMetadata
from kernels.metadata import padded_tables

CS = 4


def naive(x: StepInputs, width: int) -> dict[str, list]:
    """The step's tensors one position at a time (what the runner built before)."""
    out = {k: [] for k in ("positions", "slots", "rows", "query_start", "tables")}
    out["query_start"].append(0)
    for i, (s, e, t) in enumerate(zip(x.starts, x.ends, x.tables, strict=True)):
        out["positions"] += range(s, e)
        out["slots"] += [t[p // CS] * CS + p % CS for p in range(s, e)]
        out["query_start"].append(out["query_start"][-1] + e - s)
        out["tables"].append(t + [0] * (width - len(t)))
        if i in x.sample:
            out["rows"].append(out["query_start"][-1] - 1)
    return out


def random_step(rng: random.Random, n: int) -> StepInputs:
    x = StepInputs()
    for i in range(n):
        start = rng.randrange(0, 40)
        end = start + rng.choice([1, 1, 2, 7, 13])
        x.starts.append(start)
        x.ends.append(end)
        x.tables.append(rng.sample(range(200), -(-end // CS)))
        x.ids += [rng.randrange(1000) for _ in range(end - start)]
        if rng.random() < 0.7:
            x.sample.append(i)
    return x


@pytest.mark.parametrize("seed", range(6))
def test_build_equals_the_per_token_definition(seed):
    rng = random.Random(seed)
    x = random_step(rng, rng.choice([1, 3, 17]))
    if seed == 0:  # decode-only, every piece sampling: the fast path
        x = StepInputs(
            ids=[5, 6], starts=[9, 3], ends=[10, 4], tables=[[7, 8, 9], [4]], sample=[0, 1]
        )
    width = max(len(t) for t in x.tables) + (seed % 2) * 3
    b = build(x, CS, width if seed % 2 else None)
    want = naive(x, width)
    assert b.ids.tolist() == x.ids
    assert b.positions.tolist() == want["positions"]
    assert b.slots.tolist() == want["slots"]
    assert b.rows.tolist() == want["rows"]
    assert b.query_start.tolist() == want["query_start"]
    assert b.query_pos.tolist() == x.starts
    assert b.tables.tolist() == want["tables"]
    assert b.ids.dtype == b.slots.dtype == b.rows.dtype == torch.int64
    assert b.query_start.dtype == b.query_pos.dtype == b.tables.dtype == torch.int32


def test_padded_tables_and_metadata_build():
    assert padded_tables([[3, 4], [], [5]]).tolist() == [[3, 4], [0, 0], [5, 0]]
    assert padded_tables([[1, 2]], width=4).tolist() == [[1, 2, 0, 0]]
    assert padded_tables([]).shape == (0, 1)
    with pytest.raises(ValueError):
        padded_tables([[1, 2, 3]], width=2)
    m = AttentionMetadata.build([3, 1], [0, 9], [[2], [5, 6, 7]], "cpu")
    assert m.query_start.tolist() == [0, 3, 4] and m.query_pos.tolist() == [0, 9]
    assert m.block_tables.tolist() == [[2, 0, 0], [5, 6, 7]]
