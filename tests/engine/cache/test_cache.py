"""KVCacheManager bookkeeping with tiny pools: exact residency after scripted sequences."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cache.manager import KVCacheManager
from engine.cache.order import REORDER_MAX_S, REORDER_S, REORDER_SHARE, _LazyHeap
from engine.cache.policy import CostModel, Policy
from engine.kv_layout import KVLayout
from engine.persistence import LocalClock

CS = 4  # tiny chunks keep the scripts readable
# Six layers, 2 and 5 full: a page holds 2 layers; a chunk inside the 6-position window holds
# 3 pages, one outside it (engine/kv_layout.py)
WINDOWED = KVLayout(6, 2, (0, 1, 0, 0, 1, 1), (1, 1, 0, 2, 2, 0), window=6)
# Every layer slides over 6 positions: one group, a chunk the window left holds nothing
GONE = KVLayout(6, 6, tuple(range(6)), (0,) * 6, window=6)
LAYOUTS = [None, WINDOWED, GONE]


class FakeTime:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def manager(gpu: int, cpu: int, mode="pensieve", eviction="pensieve", **kw):
    now = FakeTime()
    clock = LocalClock(now=now)
    policy = Policy(eviction, CostModel.linear(CS, 1024), CS, clock)
    for k in range(100):  # gaps of 1-20 s after 4 of 5 turns, for the `returns` value
        policy.returns.ended()
        if k % 5:
            policy.returns.returned(1.0 + k % 20)
    return KVCacheManager(gpu, cpu, CS, policy, mode, now=now, **kw), clock, now


def turn(m: KVCacheManager, clock, cid: str, tokens: int, when: float) -> None:
    """A whole turn in a step of its own: admit to `tokens` positions, compute them all, release."""
    m.begin_step()
    table = m.table(cid)
    m.admit(table, table.tokens, tokens)
    m.release(table, tokens)
    clock.touch(cid, when)
    m.check()


def test_idle_conversation_leading_chunks_go_first():
    m, clock, now = manager(gpu=6, cpu=4)
    turn(m, clock, "old", 12, when=900.0)  # 3 chunks, idle for 100 s
    turn(m, clock, "new", 12, when=999.0)  # 3 chunks, idle for 1 s
    assert m.gpu.num_free == 0
    # A third conversation needs 2 blocks: the leading chunks of "old" move to the CPU.
    turn(m, clock, "third", 8, when=1000.0)
    assert m.table("old").tiers() == ["cpu", "cpu", "gpu"]
    assert m.table("new").tiers() == ["gpu", "gpu", "gpu"]
    plan_out = m.counters.swapped_out_tokens
    assert plan_out == 8


def test_cpu_full_drops_leading_chunks():
    m, clock, now = manager(gpu=4, cpu=2)
    turn(m, clock, "a", 16, when=900.0)  # fills the GPU
    turn(m, clock, "b", 8, when=990.0)  # a's first two chunks -> CPU
    assert m.table("a").tiers() == ["cpu", "cpu", "gpu", "gpu"]
    turn(m, clock, "c", 8, when=995.0)  # a's next two -> CPU, its first two are dropped
    assert m.table("a").tiers() == ["dropped", "dropped", "cpu", "cpu"]
    assert m.table("b").tiers() == ["gpu", "gpu"]
    assert m.counters.dropped_tokens == 8


def test_admission_swaps_in_and_recomputes():
    m, clock, now = manager(gpu=4, cpu=2)
    turn(m, clock, "a", 16, when=900.0)
    turn(m, clock, "b", 8, when=990.0)
    turn(m, clock, "c", 8, when=995.0)
    conv = m.table("a")
    now.t = 1001.0
    m.begin_step()
    # its last token's KV was never computed: 4 chunks, the last one partial
    adm = m.admit(conv, 15, 16)  # a returns: needs the whole GPU
    assert (adm.recompute_tokens, adm.swapped_in_tokens, adm.cached_tokens) == (8, 7, 0)
    assert conv.tiers() == ["gpu"] * 4
    # The CPU held only a's chunks (pinned now), so b and c had to be dropped.
    assert m.table("b").tiers() == ["dropped"] * 2 and m.table("c").tiers() == ["dropped"] * 2
    assert len(adm.copies.swap_in) == 2
    m.check()


def test_gpu_mode_drops_instead_of_swapping():
    m, clock, now = manager(gpu=4, cpu=8, mode="gpu")
    assert m.cpu.num_blocks == 0
    turn(m, clock, "a", 16, when=900.0)
    turn(m, clock, "b", 8, when=990.0)
    assert m.table("a").tiers() == ["dropped", "dropped", "gpu", "gpu"]


def test_stateless_keeps_nothing():
    m, clock, now = manager(gpu=8, cpu=8, mode="stateless")
    turn(m, clock, "a", 10, when=900.0)
    assert m.table("a").tiers() == ["dropped"] * 3
    assert m.gpu.num_free == 8


def test_lru_evicts_whole_oldest_conversation_first():
    m, clock, now = manager(gpu=6, cpu=0, mode="gpu", eviction="lru")
    turn(m, clock, "old", 12, when=900.0)
    turn(m, clock, "new", 12, when=999.0)
    turn(m, clock, "third", 12, when=1000.0)
    assert m.table("old").tiers() == ["dropped"] * 3
    assert m.table("new").tiers() == ["gpu"] * 3


def test_pensieve_prefers_cheap_leading_chunks_of_recent_conversations():
    # Cost grows with context: the long idle conversation's late chunks are worth more than
    # the recent one's first chunk once its idle time is not much larger.
    m, clock, now = manager(gpu=12, cpu=0, mode="gpu")
    m.policy.cost = CostModel([4, 8, 16, 32, 64], [1.0, 2.0, 4.0, 8.0, 16.0], 0.0)
    turn(m, clock, "long", 48, when=998.0)  # 12 chunks, idle 2 s
    conv = m.table("long")
    assert conv.tiers() == ["gpu"] * 12
    turn(m, clock, "short", 4, when=999.5)  # 1 chunk: evicts "long"'s first chunk only
    assert m.table("long").tiers()[:2] == ["dropped", "gpu"]
    assert m.table("short").tiers() == ["gpu"]


def test_ahead_of_time_swap_out_under_threshold():
    m, clock, now = manager(gpu=8, cpu=8, swap_out_threshold=0.25)
    turn(m, clock, "a", 32, when=900.0)  # all 8 blocks used, none free
    plan = m.swap_out_ahead()
    assert len(plan.background) == 2  # 25% of 8
    assert not plan.swap_out and not plan.swap_in
    # The GPU blocks stay until reallocated; the chunks are still GPU-resident with a copy.
    assert m.table("a").tiers() == ["gpu"] * 8
    assert m.reclaimable() == 2
    assert not m.swap_out_ahead()  # already at the threshold
    # Reallocation reclaims them at no cost: no synchronous swap-out.
    turn(m, clock, "b", 8, when=1000.0)
    assert m.table("a").tiers()[:2] == ["cpu", "cpu"]
    m.check()


def test_copies_made_ahead_are_counted_by_what_became_of_them():
    m, clock, now = manager(gpu=10, cpu=12, swap_out_threshold=0.6)
    turn(m, clock, "a", 32, when=900.0)  # 8 of 10 blocks used
    assert len(m.swap_out_ahead().background) == 4  # a's chunks 0-3, copied ahead
    c = m.counters
    assert (c.ahead_chunks, c.ahead_reclaimed_chunks, c.ahead_wasted_chunks) == (4, 0, 0)
    turn(m, clock, "b", 16, when=1000.0)  # 2 free blocks, 2 reclaimed: no swap-out, no drop
    assert m.table("a").tiers()[:3] == ["cpu", "cpu", "gpu"]
    assert not m.table("b").chunks[0].ahead
    assert c.ahead_reclaimed_chunks == 2 and c.swapped_out_tokens == 16
    now.t = 1100.0
    turn(m, clock, "a", 36, when=1100.0)  # a comes back: chunks 0-1 read back, 2-3 were
    # still on the GPU (their copies stay, unused so far)
    assert c.ahead_read_chunks == 2 and c.ahead_wasted_chunks == 0
    m.forget("b")
    m.forget("a")  # chunks 2-3 freed with their copies: never of use
    assert (c.ahead_chunks, c.ahead_reclaimed_chunks, c.ahead_read_chunks) == (4, 2, 2)
    assert c.ahead_wasted_chunks == 2
    m.check()


def test_ahead_copies_keep_free_only_what_recent_steps_allocate():
    m, clock, now = manager(gpu=64, cpu=64, swap_out_threshold=0.5)
    turn(m, clock, "big", 64 * CS, when=990.0)  # the GPU tier is full
    for _ in range(500):  # steps that allocate nothing, for a while (measured, no copies)
        m.begin_step()
        assert not m.swap_out_ahead(busy=True)
    assert m.evictor.peak < 1
    plan = m.swap_out_ahead()
    # what 8 such steps allocate, not half the tier (32) as the threshold alone would ask
    assert 0 < len(plan.background) <= 8 and m.reclaimable() == len(plan.background)
    m.check()


def test_swap_out_waits_for_swap_in():
    m, clock, now = manager(gpu=8, cpu=8)
    turn(m, clock, "a", 32, when=900.0)
    assert not m.swap_out_ahead(busy=True)


def test_admission_keeps_ten_percent_for_decoding():
    m, clock, now = manager(gpu=20, cpu=0, admit_reserve=0.10)
    first = m.table("a")
    assert m.can_admit(first, 19 * CS)  # nothing running: a lone turn may use it all
    m.admit(first, 0, 10 * CS)
    second = m.table("b")
    assert m.can_admit(second, 8 * CS)  # 18 pinned of 20: 10% left
    assert not m.can_admit(second, 9 * CS)  # 19 pinned: under 10% left


def test_suspend_moves_running_turn_off_gpu_and_back():
    m, clock, now = manager(gpu=6, cpu=6)
    conv = m.table("a")
    m.admit(conv, 0, 10)
    m.begin_step()
    copies = m.suspend(conv, 10)
    assert len(copies.swap_out) == 3 and not copies.swap_in
    assert conv.tiers() == ["cpu"] * 3 and not conv.pinned
    assert m.counters.suspensions == 1
    assert m.gpu.num_free == 6
    m.begin_step()
    adm = m.admit(conv, 10, 11)
    assert adm.swapped_in_tokens == 10
    assert sorted(cpu for cpu, _ in adm.copies.swap_in) == sorted(c for _, c in copies.swap_out)
    m.check()


def test_growth_fails_only_when_everything_is_pinned():
    m, clock, now = manager(gpu=2, cpu=0, mode="gpu")
    a = m.table("a")
    m.admit(a, 0, 8)
    assert m.grow(a, 8, 9) is None  # both blocks pinned by itself
    m.release(a, 8)
    b = m.table("b")
    m.admit(b, 0, 4)  # evicts a's leading chunk
    assert a.tiers() == ["dropped", "gpu"]
    assert m.grow(b, 4, 8) is not None  # and then the other one
    assert a.tiers() == ["dropped", "dropped"]


def test_growth_that_runs_out_keeps_the_copies_of_what_it_evicted():
    """An idle chunk swapped out before the room ran out has left its GPU block: its copy
    must still run (it goes into the step's plan), or its CPU block holds nothing."""
    from engine.copies import CopyPlan

    m, clock, now = manager(gpu=3, cpu=4)
    turn(m, clock, "idle", 4, when=900.0)  # one chunk, on the GPU
    a = m.table("a")
    m.begin_step()
    m.admit(a, 0, 8)  # two chunks: the GPU tier is full
    plan = CopyPlan()
    assert m.grow(a, 8, 16, plan) is None  # two more: only the idle chunk can make room
    idle = m.table("idle").chunks[0]
    assert m.table("idle").tiers() == ["cpu"]
    assert plan.swap_out == [(0, idle.cpu)]
    assert m.grow(a, 8, 12, plan) is plan  # one more fits in the block it freed
    assert plan.swap_out == [(0, idle.cpu)]
    m.check()


def test_forget_frees_everything():
    m, clock, now = manager(gpu=4, cpu=4)
    turn(m, clock, "a", 16, when=900.0)
    m.forget("a")
    assert m.gpu.num_free == 4 and "a" not in m.tables
    m.check()


def test_double_release_is_caught():
    m, *_ = manager(gpu=2, cpu=0)
    b = m.gpu.allocate()
    m.gpu.release(b)
    with pytest.raises(RuntimeError):
        m.gpu.release(b)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 5), st.integers(1, 12), st.integers(0, 50)),
        min_size=1,
        max_size=40,
    ),
    gpu=st.integers(4, 16),
    cpu=st.integers(0, 12),
    mode=st.sampled_from(["pensieve", "gpu", "stateless"]),
    eviction=st.sampled_from(["pensieve", "returns", "lru"]),
    layout=st.sampled_from(LAYOUTS),
)
def test_random_workload_never_leaks_or_breaks_layout(ops, gpu, cpu, mode, eviction, layout):
    """Randomized multi-turn workload: after every step, no block is leaked or double-owned
    and every conversation is laid out [dropped | CPU | GPU]; with sliding groups, every
    chunk a sliding layer may still read holds their pages, and none the window left (where
    every layer slides: no page at all)."""
    pages = 3 if layout is WINDOWED else 1
    m, clock, now = manager(
        gpu=gpu * pages, cpu=cpu * pages, mode=mode, eviction=eviction, layout=layout
    )
    kv_len: dict[str, int] = {}  # what the engine's stream records would say
    running = {}
    for cid_n, grow_by, dt in ops:
        now.t += dt
        m.begin_step()
        cid = f"c{cid_n}"
        table = m.table(cid)
        target = kv_len.get(cid, 0) + grow_by
        if cid in running:  # decode a few tokens, or end the turn
            if m.grow(table, kv_len[cid], target) is not None:
                m.windows.slide(table, kv_len[cid])  # as a launched step does: up to its start
                kv_len[cid] = target
            else:
                m.suspend(table, kv_len[cid])
                del running[cid]
            if grow_by > 8 and cid in running:
                m.release(table, kv_len[cid])
                clock.touch(cid)
                del running[cid]
        elif m.can_admit(table, target):
            adm = m.admit(table, kv_len.get(cid, 0), target)
            # its first step: from position 0 where it recomputes (sliding pages as it goes)
            if m.grow(table, kv_len.get(cid, 0), target, start=0 if adm.recompute_tokens else None):
                kv_len[cid] = target
                running[cid] = True
            else:
                m.suspend(table, kv_len.get(cid, 0))
        m.swap_out_ahead()
        m.check()
        if layout is not None:
            check_windows(m, kv_len, running)


def check_windows(m: KVCacheManager, kv_len: dict[str, int], running: dict) -> None:
    """Every held chunk a sliding layer may still read holds every group's pages (a running
    turn's: all it computes too), and none before `slid` does; where every layer slides, the
    chunks gone hold nothing and are all before the window."""
    for cid, t in m.tables.items():
        n = kv_len.get(cid, 0)
        first = m.windows.kept_from(n)
        if m.windows.gone:
            assert t.gone <= first or t.pinned, (cid, t.gone, first)
            assert all(c.gpu is None and c.cpu is None for c in t.chunks[: t.gone]), cid
            continue
        for i, c in enumerate(t.chunks):
            held = c.gpu is not None or c.cpu is not None
            if held and i >= first:
                assert c.gpu is None or c.gpu_win is not None, (cid, i, "window lost")
                assert c.cpu is None or c.gpu is not None or c.cpu_win is not None, (cid, i)


def test_a_chunk_the_window_left_frees_its_sliding_pages():
    """A chunk holds 3 pages while inside the window and 1 after it; the pages come back."""
    m, clock, now = manager(gpu=30, cpu=0, layout=WINDOWED)
    t = m.table("a")
    m.admit(t, 0, 12)  # 3 chunks, all computed: every group's pages
    assert m.gpu.num_used == 9
    m.windows.slide(t, 12)  # a query at 12 or later reads from position 7: chunk 1 on
    assert [len(c.gpu_pages()) for c in t.chunks] == [1, 3, 3]
    assert m.gpu.num_used == 7 and t.slid == 1
    m.release(t, 12)
    m.check()
    assert m.tiers.reclaimable == 0 and m.tiers.pinned_gpu == 0
    # a window reaching back past chunks that lost their pages: recompute them
    m.truncate(t, 5)
    assert t.n_dropped == 1 and t.slid == 0
    m.check()


def test_a_chunk_every_layer_left_holds_nothing_until_one_after_it_is_lost():
    """Every layer slides: chunks the window left are freed on every tier and are `gone` (a
    return recomputes nothing); once a chunk after them is dropped, the admission recomputes
    from position 0, and eviction prices that."""
    m, clock, now = manager(gpu=8, cpu=0, layout=GONE)
    turn(m, clock, "a", 16, when=990.0)  # 4 chunks; a query at 16 reads from position 11 on
    a = m.tables["a"]
    assert a.tiers() == ["dropped", "dropped", "gpu", "gpu"] and a.gone == 2
    assert m.gpu.num_used == 2 and m.recompute_tokens(a, 16) == 0
    # chunk 2, the first held, costs the recompute of chunks 0-2
    assert m.policy.value(a, 2, now.t) > 2 * m.policy.value(m.table("x"), 2, now.t)
    turn(m, clock, "a", 20, when=991.0)  # nothing recomputed: the window is held
    assert m.counters.recomputed_tokens == 0 and a.gone == 3
    turn(m, clock, "b", 28, when=1000.0)  # b's 7 chunks during its turn: a's chunk 3 goes
    assert a.missing and m.recompute_tokens(a, 20) == 16  # chunks 0-3: from position 0
    now.t += 1
    m.begin_step()
    adm = m.admit(a, 20, 24)  # recomputed from position 0: every chunk gets a page again
    assert adm.recompute_tokens == 16 and a.gone == 0 and all(c.gpu is not None for c in a.chunks)
    m.release(a, 24)
    assert a.gone == m.windows.gone_before(24) == 4
    assert m.gpu.num_used == sum(len(t.chunks) - t.gone for t in m.tables.values())
    m.check()
    m.truncate(a, 6)  # back over chunks gone: recomputed from the start
    assert a.gone == 0 and a.missing
    m.check()


def test_prefetch_swaps_in_back_first_and_keeps_the_copies():
    m, clock, now = manager(gpu=6, cpu=8)
    turn(m, clock, "a", 16, when=1000.0)
    now.t = 1010.0
    turn(m, clock, "b", 16, when=1010.0)  # a's first two chunks go to the CPU
    a, b = m.tables["a"], m.tables["b"]
    assert a.tiers() == ["cpu", "cpu", "gpu", "gpu"]
    cpu_blocks = [c.cpu for c in a.chunks[:2]]
    now.t = 1030.0
    clock.touch("a")  # typing: a is worth more than b, idle for 20 s
    m.policy.expect("a", 1045.0)  # as the engine marks it before a prefetch
    m.begin_step()
    copies, done = m.prefetch(a)
    assert done and a.tiers() == ["gpu"] * 4
    # back of the CPU run first; b's lowest-value chunks made the room (swapped out)
    assert [src for src, _ in copies.swap_in] == cpu_blocks[::-1]
    assert len(copies.swap_out) == 2 and b.tiers()[:2] == ["cpu", "cpu"]
    assert all(c.cpu is not None for c in a.chunks[:2])  # reclaimable for free
    assert m.counters.prefetched_tokens == 8
    m.check()
    m.begin_step()
    adm = m.admit(a, 16, 17)
    assert (adm.cached_tokens, adm.swapped_in_tokens, adm.prefetched_tokens) == (16, 0, 8)
    m.check()


def test_a_prefetch_never_takes_the_room_of_another_expected_conversation():
    """Two users type at once and the GPU tier holds one context: the second prefetch (a
    swap-in or a recompute) does not undo the first; once nobody types in the first, it may."""
    m, clock, now = manager(gpu=4, cpu=4)
    turn(m, clock, "a", 16, when=1000.0)
    now.t = 1010.0
    turn(m, clock, "b", 16, when=1010.0)
    a, b = m.tables["a"], m.tables["b"]
    assert a.tiers() == ["cpu"] * 4 and b.tiers() == ["gpu"] * 4
    now.t = 1030.0
    m.policy.expect("b", 1040.0)  # b's user types: its context is on the GPU, as it should
    m.policy.expect("a", 1045.0)
    clock.touch("a")  # a's user types later: a is worth more than b
    m.begin_step()
    copies, done = m.prefetch(a)
    assert not copies and not done and b.tiers() == ["gpu"] * 4
    m.policy.unexpect("b")  # b's turn came and went
    m.begin_step()
    copies, done = m.prefetch(a)
    assert done and a.tiers() == ["gpu"] * 4 and "gpu" not in b.tiers()
    m.check()

    m, clock, now = manager(gpu=4, cpu=0)  # no CPU tier: a is dropped
    turn(m, clock, "a", 16, when=1000.0)
    turn(m, clock, "b", 16, when=1010.0)
    a = m.tables["a"]
    assert a.n_dropped == 4
    now.t = 1030.0
    m.policy.expect("a", 1045.0)
    m.policy.expect("b", 1040.0)
    m.begin_step()
    assert m.can_admit(a, 16) and not m.can_prefetch(a, 16)
    m.policy.unexpect("b")
    assert m.can_prefetch(a, 16)
    adm = m.admit(a, 16, 16, prefetch=True)
    assert adm.recompute_tokens == 16 and m.tables["b"].n_dropped == 4
    m.check()


def test_prefetch_takes_no_running_blocks():
    m, clock, now = manager(gpu=4, cpu=4)
    turn(m, clock, "a", 8, when=1000.0)
    turn(m, clock, "b", 16, when=1001.0)  # a all on the CPU
    m.begin_step()
    m.admit(m.tables["b"], 16, 16)  # b runs: its blocks are pinned
    before = m.tables["a"].tiers()
    m.policy.expect("a", 1015.0)
    copies, done = m.prefetch(m.tables["a"])
    assert not copies and not done and m.tables["a"].tiers() == before == ["cpu", "cpu"]
    m.release(m.tables["b"], 16)
    m.check()
    # a prefetched conversation that does not send is evicted again like any idle one
    now.t = 1100.0
    clock.touch("a")
    m.policy.expect("a", 1115.0)
    m.begin_step()
    copies, done = m.prefetch(m.tables["a"])
    assert done and m.tables["a"].tiers() == ["gpu", "gpu"]
    now.t = 2000.0  # its user never sent: no longer expected
    clock.touch("b")
    m.begin_step()
    adm = m.admit(m.tables["b"], 16, 16)
    assert m.tables["a"].tiers() == ["cpu", "cpu"] and not adm.copies.swap_out  # no cost
    m.check()


def test_an_expected_turn_keeps_its_chunks_until_it_comes():
    """A conversation whose user is typing (`policy.expect`) keeps its GPU chunks over idle
    ones active more recently, until the expectation ends; a running turn still takes them
    when nothing else is left."""

    def run(expect: bool) -> tuple[list[str], list[str]]:
        m, clock, now = manager(gpu=6, cpu=8)
        turn(m, clock, "typist", 12, when=1000.0)  # typing started at 1000 s
        turn(m, clock, "other", 12, when=1008.0)  # its turn ended later
        if expect:
            m.policy.expect("typist", 1015.0)
        now.t = 1010.0
        turn(m, clock, "third", 8, when=1010.0)  # needs 2 of the 6 blocks
        return m.tables["typist"].tiers(), m.tables["other"].tiers()

    assert run(False) == (["cpu", "cpu", "gpu"], ["gpu"] * 3)  # the typist paid
    assert run(True) == (["gpu"] * 3, ["cpu", "cpu", "gpu"])  # the other one did

    m, clock, now = manager(gpu=4, cpu=8)
    turn(m, clock, "typist", 8, when=1000.0)
    m.policy.expect("typist", 1015.0)
    now.t = 1001.0
    turn(m, clock, "big", 16, when=1001.0)  # needs every block: it takes the typist's
    assert m.tables["typist"].tiers() == ["cpu", "cpu"]
    # the expectation ends (the turn came, or the while passed): valued as before
    m.policy.unexpect("typist")
    assert m.policy.last_active(m.tables["typist"], 1001.0) == 1000.0
    m.check()


def test_prefetch_refuses_a_table_whose_turn_is_not_expected():
    """Making room for a prefetch relies on its own chunks being expected: without that, the
    cache could drop its CPU copies (or let go of its shared run) to make room for them."""
    m, clock, now = manager(gpu=4, cpu=4)
    turn(m, clock, "a", 8, when=1000.0)
    with pytest.raises(ValueError, match="not expected"):
        m.prefetch(m.tables["a"])


def test_the_eviction_order_is_kept_for_a_share_of_the_evicted_idle_time():
    """Keys are taken at one time and reused while they are younger than 5% of the idle time
    of what was evicted (at least REORDER_S, at most REORDER_MAX_S), until a turn ends."""
    m, clock, now = manager(gpu=4, cpu=8)
    turn(m, clock, "a", 8, when=900.0)  # idle 100 s
    turn(m, clock, "b", 8, when=990.0)  # idle 10 s
    now.t = 1000.0
    m.begin_step()  # b's turn ended since: the keys are taken now
    keys = m.order.key_now
    assert keys == 1000.0
    c = m.table("c")
    m.admit(c, 0, 8)  # evicts a's chunks (idle 100 s); c goes on running
    assert m.table("a").tiers() == ["cpu", "cpu"]
    # a was idle 100 s: the order is kept for 5 s ...
    assert REORDER_S < REORDER_SHARE * 100 < REORDER_MAX_S
    for t in (keys + REORDER_S / 2, keys + REORDER_SHARE * 100 - 1):
        now.t = t
        m.begin_step()
        assert m.order.key_now == keys
    now.t = keys + REORDER_SHARE * 100 + 1  # ... and taken again after it
    m.begin_step()
    assert m.order.key_now == now.t
    keys = now.t
    m.release(c, 8)  # a turn ends: c joins the heaps as it is, no rebuild
    now.t += 0.1
    m.begin_step()
    assert m.order.key_now == keys
    m.check()


@pytest.mark.parametrize("eviction", ["pensieve", "lru", "returns"])
def test_a_turn_ended_after_the_keys_were_taken_keeps_its_chunks(eviction):
    """A table released after the eviction keys were taken, and stamped active after its
    release (as the engine does), goes after older idle chunks with no rebuild of the heaps:
    its entry, keyed at its release, is keyed again when popped."""
    m, clock, now = manager(gpu=4, cpu=8, eviction=eviction)
    turn(m, clock, "old", 8, when=900.0)  # idle 100 s
    now.t = 1000.0
    m.begin_step()
    keys = m.order.key_now
    b = m.table("b")  # never stamped so far: by the clock, as idle as can be
    m.admit(b, 0, 8)
    now.t += 0.1
    m.release(b, 8)
    clock.touch("b", now.t)
    now.t += 0.1
    m.begin_step()
    assert m.order.key_now == keys
    c = m.table("c")
    m.admit(c, 0, 8)  # takes 2 of the 4 blocks
    assert m.table("old").tiers() == ["cpu", "cpu"]
    assert b.tiers() == ["gpu", "gpu"]
    m.check()


def test_a_new_expectation_reorders_at_once():
    m, clock, now = manager(gpu=4, cpu=8)
    turn(m, clock, "a", 8, when=900.0)
    turn(m, clock, "b", 8, when=990.0)
    m.begin_step()
    keys = m.order.key_now
    now.t += 0.1
    m.policy.expect("a", now.t + 10)  # a's user is typing: a is kept over b
    turn(m, clock, "c", 8, when=now.t)
    assert m.order.key_now == keys  # a's keys alone were taken again, not every table's
    assert m.table("a").tiers() == ["gpu", "gpu"]
    assert m.table("b").tiers() == ["cpu", "cpu"]


def test_an_expectation_withdrawn_reorders_without_a_rebuild():
    """A's turn was expected (so b's chunks went first), then refused: a's keys drop back
    below b's at the next step, by a's entry pushed again, not by rebuilding every key."""
    m, clock, now = manager(gpu=4, cpu=8)
    turn(m, clock, "a", 8, when=900.0)
    turn(m, clock, "b", 8, when=990.0)
    m.policy.expect("a", math.inf)
    turn(m, clock, "c", 8, when=now.t)  # the heaps are built: b's chunks go first
    assert m.table("b").tiers() == ["cpu", "cpu"]
    keys = m.order.key_now
    now.t += 0.1
    m.policy.withdrawn("a")
    turn(m, clock, "d", 8, when=now.t)
    assert m.order.key_now == keys
    assert m.table("a").tiers() == ["cpu", "cpu"]
    assert m.table("c").tiers() == ["gpu", "gpu"]


def test_the_lazy_heap_counts_only_an_items_latest_entry():
    """Tables pushed again and again (every change of a chunk) leave one live entry each:
    a pop drops the older ones instead of putting them back."""
    keys = {"a": 5.0, "b": 3.0}
    heap = _LazyHeap(front=lambda t: 0, key=lambda t, i: keys[t])
    heap.ensure(["a", "b"])
    for k in range(100):  # a gets cheaper, then dearer, many times
        keys["a"] = float(k % 7)
        heap.push("a")
    keys["a"] = 4.0
    heap.push("a")
    assert heap.pop() == ("b", 0)
    keys["b"] = 10.0  # b gave up its chunk: dearer now
    heap.push("b")
    assert heap.pop() == ("a", 0)
    # The stale entries popped on the way were dropped, not put back under a's new key.
    assert sum(1 for k, _, t in heap.heap if t == "a" and k == 4.0) == 1


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 5), st.integers(1, 12), st.integers(0, 50), st.booleans()),
        min_size=1,
        max_size=40,
    ),
    gpu=st.integers(4, 16),
    cpu=st.integers(0, 12),
    layout=st.sampled_from(LAYOUTS),
)
def test_random_workload_with_a_disk_tier(ops, gpu, cpu, layout):
    """With a disk tier: every chunk that loses its last copy in memory is handed over
    (full chunks only, from a block it still owns), and admissions that load part of a
    dropped run from disk keep every invariant (with sliding layers too; where every layer
    slides, the loads start at the first chunk not gone)."""
    pages = 3 if layout is WINDOWED else 1
    m, clock, now = manager(gpu=gpu * pages, cpu=cpu * pages, layout=layout)
    m.spilling = True
    cs = m.chunk_size
    kv_len: dict[str, int] = {}
    running = {}
    for cid_n, grow_by, dt, load in ops:
        now.t += dt
        m.begin_step()
        cid = f"c{cid_n}"
        table = m.table(cid)
        target = kv_len.get(cid, 0) + grow_by
        if cid in running:
            if m.grow(table, kv_len[cid], target) is not None:
                m.windows.slide(table, kv_len[cid])
                kv_len[cid] = target
            else:
                m.suspend(table, kv_len[cid])
                del running[cid]
            if grow_by > 8 and cid in running:
                m.release(table, kv_len[cid])
                clock.touch(cid)
                del running[cid]
        elif m.can_admit(table, target):
            full = min(m.loadable(table), kv_len.get(cid, 0) // cs)
            span = (full // 2, full) if load and full else None
            gone = table.gone
            adm = m.admit(table, kv_len.get(cid, 0), target, loaded=span)
            if span and span[0] <= gone < span[1]:
                span = (gone, span[1])  # the chunks gone need not come back
            assert [i for i, _ in adm.loads] == list(range(*span)) if span else not adm.loads
            assert adm.disk_tokens == len(adm.loads) * cs
            start = 0 if adm.recompute_tokens else adm.recompute_from
            if m.grow(table, kv_len.get(cid, 0), target, start=start):
                kv_len[cid] = target
                running[cid] = True
            else:
                m.suspend(table, kv_len.get(cid, 0))
        m.swap_out_ahead()
        for owner, i, tier, pages in m.take_spills():
            t = m.tables[owner]
            assert (i + 1) * cs <= t.tokens and tier in ("gpu", "cpu")
            n = m.gpu.num_blocks if tier == "gpu" else m.cpu.num_blocks
            assert len(pages) in (1, m.tiers.groups)
            assert all(0 <= block < n for block in pages)
        m.check()
        if layout is not None:
            check_windows(m, kv_len, running)


def test_a_disk_tier_caps_the_value_at_its_read_time():
    """With a disk tier a dropped chunk costs at most a read to bring back: chunks whose
    recompute costs more are worth the read over their idle time, so the idlest go first."""
    m, clock, now = manager(gpu=8, cpu=0)
    p = m.policy
    t = m.table("a")
    clock.touch("a", now.t - 10.0)
    uncapped = [p.value(t, i, now.t) for i in range(4)]
    assert uncapped == sorted(uncapped) and uncapped[0] < uncapped[-1]
    cap = (p.cost(2 * CS) + p.cost(3 * CS)) / 2  # between chunk 2's cost and chunk 3's
    p.restore_s = lambda: cap
    capped = [p.value(t, i, now.t) for i in range(4)]
    assert capped[:3] == uncapped[:3] and capped[3] == cap / 10.0
    p.restore_s = lambda: None  # the tier stopped writing: recompute costs again
    assert [p.value(t, i, now.t) for i in range(4)] == uncapped
