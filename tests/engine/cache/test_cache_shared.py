"""Shared prefix chunks in KVCacheManager: scripted cases, and a randomized workload over a
fake KV pool that carries out every copy and write and checks every position read."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cache.manager import KVCacheManager, chain_hashes
from engine.cache.policy import CostModel
from engine.copies import CopyPlan
from tests.engine.cache.test_cache import CS, manager

# Two system prompts that share their first chunk (a branching chain), 2 and 3 chunks long.
SYS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 10, 11, 12, 13, 14, 15, 16, 17, 18]]


class Sim:
    """Drives the cache as the engine does (link at the start of a conversation, admit,
    grow, suspend, release, publish the first prompt) over a fake pool whose slots hold
    (position, hash of the stream up to it): a read of a wrong, stale or foreign slot
    shows."""

    def __init__(self, gpu: int, cpu: int, mode: str = "pensieve", share: bool = True) -> None:
        self.m, self.clock, self.now = manager(gpu, cpu, mode=mode, share=share)
        self.gpu_kv: dict[int, list] = {}
        self.cpu_kv: dict[int, list] = {}
        self.streams: dict[str, list[int]] = {}
        self.kv_len: dict[str, int] = {}
        self.state: dict[str, str] = {}  # idle | waiting | running
        self.chain: dict[str, list[bytes]] = {}  # first turn still to publish

    # ---- the fake pool ----------------------------------------------------------------------

    def slot(self, cid: str, p: int) -> tuple[int, int]:
        return (p, hash(tuple(self.streams[cid][: p + 1])))

    def copy(self, plan: CopyPlan, after: bool = False) -> None:
        if after:
            for g, c in plan.background:
                self.cpu_kv[c] = list(self.gpu_kv[g])
            return
        for g, c in plan.swap_out:
            self.cpu_kv[c] = list(self.gpu_kv[g])
        for c, g in plan.swap_in:
            self.gpu_kv[g] = list(self.cpu_kv[c])
        assert not plan.background

    def write(self, cid: str, start: int, end: int) -> None:
        t = self.m.tables[cid]
        for p in range(start, end):
            c = t.chunks[p // CS]
            assert not c.shared, "a shared chunk is written"
            self.gpu_kv.setdefault(c.gpu, [None] * CS)[p % CS] = self.slot(cid, p)

    def verify(self) -> None:
        """Every held copy of every position with KV holds that position's KV."""
        for cid, t in self.m.tables.items():
            for p in range(self.kv_len[cid]):
                c = t.chunks[p // CS]
                for block, kv in ((c.gpu, self.gpu_kv), (c.cpu, self.cpu_kv)):
                    if block is not None:
                        assert kv[block][p % CS] == self.slot(cid, p), (cid, p, c)
                if self.state[cid] == "running":
                    assert c.gpu is not None, (cid, p, "running, off the GPU")
        self.m.check()

    # ---- what the engine does ---------------------------------------------------------------

    def submit(self, cid: str, tokens: list[int]) -> None:
        t = self.m.table(cid)
        stream = self.streams.setdefault(cid, [])
        self.kv_len.setdefault(cid, 0)
        if not stream and not t.chunks:  # a conversation starts: link its prompt's chunks
            chain = chain_hashes(tokens, CS)
            self.kv_len[cid] = self.m.link(t, chain[: (len(tokens) - 1) // CS])
            self.chain[cid] = chain
        stream += tokens
        self.state[cid] = "waiting"

    def admit(self, cid: str, stop_early: bool) -> None:
        t, kv = self.m.tables[cid], self.kv_len[cid]
        total = len(self.streams[cid])
        need = self.m.recompute_tokens(t, kv)
        if not self.m.can_admit(t, total):
            return
        adm = self.m.admit(t, kv, total)
        assert adm.recompute_tokens == need
        self.copy(adm.copies)
        self.state[cid] = "running"
        if stop_early and adm.recompute_tokens > 1:  # suspended half way through a recompute
            self.write(cid, 0, adm.recompute_tokens // 2)
            self.m.drop_prefix(t, adm.recompute_tokens)
            self.copy(self.m.suspend(t, kv))
            self.state[cid] = "waiting"
            return
        self.write(cid, 0, adm.recompute_tokens)
        self.write(cid, kv, total)
        self.kv_len[cid] = total

    def grow(self, cid: str, tokens: list[int]) -> None:
        t, kv = self.m.tables[cid], self.kv_len[cid]
        copies = self.m.grow(t, kv, kv + len(tokens))
        if copies is None:
            self.copy(self.m.suspend(t, kv))
            self.state[cid] = "waiting"
            return
        self.copy(copies)
        self.streams[cid] += tokens
        self.write(cid, kv, kv + len(tokens))
        self.kv_len[cid] += len(tokens)

    def end(self, cid: str) -> None:
        t = self.m.tables[cid]
        if self.state[cid] == "running":
            self.m.release(t, self.kv_len[cid])
        self.state[cid] = "idle"
        self.clock.touch(cid)
        chain = self.chain.pop(cid, [])
        self.m.publish(t, chain[: self.kv_len[cid] // CS])

    def prefetch(self, cid: str) -> None:
        """The user is typing: swap the CPU chunks in, or recompute a dropped prefix."""
        t, kv = self.m.tables[cid], self.kv_len[cid]
        self.clock.touch(cid)
        self.m.policy.expect(cid, self.now.t + 15)  # as the engine does: its turn is coming
        if t.n_dropped:
            if self.m.can_admit(t, kv):
                adm = self.m.admit(t, kv, kv, prefetch=True)
                self.copy(adm.copies)
                self.write(cid, 0, adm.recompute_tokens)
                self.m.release(t, kv)
            return
        copies, _ = self.m.prefetch(t)
        self.copy(copies)

    def truncate(self, cid: str, length: int) -> None:
        self.m.truncate(self.m.tables[cid], length)
        del self.streams[cid][length:]
        self.kv_len[cid] = min(self.kv_len[cid], length)

    def forget(self, cid: str) -> None:
        self.m.forget(cid)
        for d in (self.streams, self.kv_len, self.state, self.chain):
            d.pop(cid, None)

    def restart(self, cid: str) -> None:
        """The process restarted: the conversation is known only to its history."""
        self.m.reset(self.m.tables[cid], len(self.streams[cid]))
        self.kv_len[cid] = len(self.streams[cid])


def holders(m: KVCacheManager, cid: str) -> list[int]:
    return m.holders(m.tables[cid])


def run_turn(sim: Sim, cid: str, tokens: list[int]) -> None:
    sim.m.begin_step()
    sim.submit(cid, tokens)
    sim.admit(cid, stop_early=False)
    assert sim.state[cid] == "running"
    sim.end(cid)
    sim.verify()


def test_conversations_starting_alike_hold_the_chunks_once():
    sim = Sim(gpu=32, cpu=8)
    run_turn(sim, "a", SYS[1] + [40, 41])  # 3 full chunks of its first prompt published
    assert holders(sim.m, "a") == [1, 1, 1, 1]
    used = sim.m.gpu.num_used
    run_turn(sim, "b", SYS[1] + [50])  # links the 3 chunks, computes the rest
    assert holders(sim.m, "b") == [2, 2, 2, 1]
    assert sim.m.tables["b"].chunks[0] is sim.m.tables["a"].chunks[0]
    assert sim.m.gpu.num_used == used + 1
    assert sim.m.counters.shared_tokens == 12
    run_turn(sim, "c", SYS[0] + [60, 61])  # the other prompt: only the first chunk is common
    assert holders(sim.m, "c") == [3, 1, 1]
    run_turn(sim, "d", [1, 2, 3, 9, 9])  # nothing common
    assert holders(sim.m, "d") == [1, 1]


def test_turns_that_started_together_give_back_their_copies():
    sim = Sim(gpu=32, cpu=0)
    sim.m.begin_step()
    for cid in "abc":  # all submitted before any computed the prompt: nothing to link
        sim.submit(cid, SYS[1] + [ord(cid)])
    for cid in "abc":
        sim.admit(cid, stop_early=False)
    assert sim.m.gpu.num_used == 12
    for cid in "abc":
        sim.end(cid)  # the first to end publishes, the others adopt the published chunks
    sim.verify()
    assert [holders(sim.m, c) for c in "abc"] == [[3, 3, 3, 1]] * 3
    assert sim.m.gpu.num_used == 3 + 3


def test_a_shared_chunk_is_worth_the_sum_of_its_holders():
    sim = Sim(gpu=8, cpu=0)
    sim.m.policy.cost = CostModel([4, 8, 16, 32, 64], [1.0, 2.0, 4.0, 8.0, 16.0], 0.0)
    for cid in "ab":
        sim.now.t = 990.0
        run_turn(sim, cid, SYS[0] + [ord(cid)])  # 2 shared chunks + 1 private each
    sim.now.t = 994.0
    run_turn(sim, "old", [9] * 8)  # 2 private chunks, less idle than a and b
    shared = sim.m.tables["a"].chunks[0]
    sim.now.t = 1000.0
    sim.m.begin_step()
    # Worth 1/10 to each of a and b, 2/10 together: more than old's first chunk (1/6).
    assert sim.m.order.key(shared, 0) == (False, False, pytest.approx(0.2), 0)
    assert sim.m.order.key(sim.m.tables["old"], 0) == (False, False, pytest.approx(1 / 6), 0)
    run_turn(sim, "new", [5] * 9)  # needs 3 blocks, 2 are free: old's first chunk goes
    assert sim.m.tables["old"].tiers() == ["dropped", "gpu"]
    assert sim.m.tables["a"].tiers() == sim.m.tables["b"].tiers() == ["gpu"] * 3


def test_an_edit_inside_a_shared_chunk_lets_it_go():
    sim = Sim(gpu=32, cpu=8)
    run_turn(sim, "a", SYS[1] + [40])
    run_turn(sim, "b", SYS[1] + [50])
    sim.truncate("b", 10)  # inside the third shared chunk: b must not write into it
    assert sim.m.tables["b"].tiers() == ["dropped"] * 3
    assert holders(sim.m, "a") == [1, 1, 1, 1]
    run_turn(sim, "b", [70, 71])  # recomputed from its history
    sim.truncate("a", 8)  # at a chunk boundary: the first two stay shared... with itself
    assert holders(sim.m, "a") == [1, 1]
    run_turn(sim, "c", SYS[1] + [80])
    assert holders(sim.m, "c") == [2, 2, 1, 1]  # the chain goes on where a's was cut


def test_forget_and_restart_give_chunks_back():
    sim = Sim(gpu=32, cpu=8)
    for cid in "abc":
        run_turn(sim, cid, SYS[0] + [ord(cid)])
    used = sim.m.gpu.num_used
    sim.forget("a")
    assert sim.m.gpu.num_used == used - 1 and holders(sim.m, "b") == [2, 2, 1]
    sim.restart("b")
    assert holders(sim.m, "c") == [1, 1, 1]
    sim.forget("c")
    assert sim.m.gpu.num_used == 0 and not sim.m.shared and not sim.m.sharing.index
    run_turn(sim, "b", [1])  # b recomputes from history
    sim.verify()


def test_baselines_do_not_share():
    for mode in ("gpu", "stateless"):
        sim = Sim(gpu=32, cpu=8, mode=mode)
        for cid in "ab":
            run_turn(sim, cid, SYS[1] + [ord(cid)])
        assert not sim.m.shared and sim.m.counters.shared_tokens == 0


OPS = st.tuples(
    st.sampled_from(["go"] * 8 + ["end", "truncate", "forget", "restart", "suspend", "prefetch"]),
    st.integers(0, 7),  # conversation
    st.integers(0, 30),  # a size, a choice, seconds that pass
)


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(OPS, min_size=20, max_size=80),
    gpu=st.integers(4, 16),
    cpu=st.integers(0, 8),
    eviction=st.sampled_from(["pensieve", "lru"]),
    seed=st.integers(0, 1 << 16),
)
def test_random_workload_keeps_refcounts_tiers_and_contents(ops, gpu, cpu, eviction, seed):
    """Conversations that start with shared system prompts, through swaps, drops, suspends,
    truncations, deletions and restarts: after every step the invariants hold (`check`)
    and every copy of every position holds that position's KV."""
    rng = random.Random(seed)
    sim = Sim(gpu, cpu)
    sim.m.policy.kind = eviction
    fits = gpu // 2  # chunks one conversation may reach
    for kind, n, x in ops:
        cid = f"c{n}"
        state = sim.state.get(cid, "idle")
        sim.now.t += x
        sim.m.begin_step()
        if kind == "go" and state == "idle":  # a turn arrives (and is admitted if it can)
            first = not sim.streams.get(cid)
            head = SYS[x % 3] if first and x % 3 < 2 else []
            tokens = head + [rng.randrange(100) for _ in range(1 + x % 7)]
            if sim.m.n_chunks(len(sim.streams.get(cid, [])) + len(tokens) + 1) <= fits:
                sim.submit(cid, tokens)
                sim.admit(cid, stop_early=x % 5 == 0)
        elif kind == "go" and state == "waiting":
            sim.admit(cid, stop_early=x % 5 == 0)
        elif kind == "go" and state == "running" and x % 4:  # decode a few tokens
            if sim.m.n_chunks(sim.kv_len[cid] + 1 + x % 6) <= fits:
                sim.grow(cid, [rng.randrange(100) for _ in range(1 + x % 6)])
        elif (kind == "go" and state == "running") or (kind == "end" and state != "idle"):
            sim.end(cid)
        elif kind == "suspend" and state == "running":
            sim.copy(sim.m.suspend(sim.m.tables[cid], sim.kv_len[cid]))
            sim.state[cid] = "waiting"
        elif kind == "truncate" and state == "idle" and cid in sim.streams:
            sim.truncate(cid, min(x, len(sim.streams[cid])))
        elif kind == "forget" and state == "idle" and cid in sim.streams:
            sim.forget(cid)
        elif kind == "restart" and state == "idle" and cid in sim.streams:
            sim.restart(cid)
        elif kind == "prefetch" and state == "idle" and cid in sim.streams:
            sim.prefetch(cid)
        sim.copy(sim.m.swap_out_ahead(), after=True)
        sim.verify()
