"""`KVCacheManager.check()` asks each part for its invariants: a table's layout, shared
chunks' holders, blocks and counts. Each corruption is caught by the part that owns it."""

from __future__ import annotations

import pytest

from tests.engine.cache.test_cache_shared import SYS, Sim, run_turn


def shared_sim() -> Sim:
    sim = Sim(gpu=32, cpu=8)
    run_turn(sim, "a", SYS[1] + [40, 41])
    run_turn(sim, "b", SYS[1] + [50])  # holds a's 3 published chunks
    sim.m.check()
    return sim


def test_a_broken_layout_is_caught_by_the_table():
    sim = shared_sim()
    sim.m.tables["b"].n_off_gpu = 4
    with pytest.raises(AssertionError, match="should be on CPU"):
        sim.m.check()


def test_a_lost_holder_is_caught_by_sharing():
    sim = shared_sim()
    shared = sim.m.tables["b"].chunks[0]
    del shared.holders[sim.m.tables["b"]]
    with pytest.raises(AssertionError, match="holders drifted"):
        sim.m.check()


def test_a_stale_index_entry_is_caught_by_sharing():
    sim = shared_sim()
    sim.m.sharing.index[b"gone"] = sim.m.tables["a"].chunks[0]
    with pytest.raises(AssertionError, match="index entry of a dead chunk"):
        sim.m.check()


def test_drifted_counts_are_caught_by_the_tiers():
    sim = shared_sim()
    sim.m.tiers.reclaimable += 1
    with pytest.raises(AssertionError, match="counts"):
        sim.m.check()


def test_a_leaked_block_is_caught_by_the_tiers():
    sim = shared_sim()
    sim.m.gpu.allocate()
    with pytest.raises(AssertionError, match="gpu blocks leaked"):
        sim.m.check()


def test_a_block_owned_twice_is_caught_by_the_tiers():
    sim = shared_sim()
    a, b = sim.m.tables["a"], sim.m.tables["b"]
    b.chunks[-1].gpu = a.chunks[-1].gpu
    with pytest.raises(AssertionError, match="owned twice"):
        sim.m.check()
