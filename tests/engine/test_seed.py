"""A seeded engine (`Engine.seed`): conversations placed in the tiers as a given state says,
through the cache's accounting; each one's next turn goes on from there, counting cached,
swapped-in, recomputed (and disk) tokens as its residency says. With real weights only an
all-dropped seed is exact (every position recomputed from the history)."""

from __future__ import annotations

import asyncio

import pytest

from engine import AsyncEngine, Engine, EngineConfig, SamplingParams, Seed, Turn
from engine.cache.manager import KVCacheManager
from engine.cache.policy import CostModel, Policy
from engine.persistence import LocalClock
from engine.request import Status
from engine.types import CacheMode

CS = 32


def cache(mode=CacheMode.PENSIEVE, gpu=16, cpu=8) -> KVCacheManager:
    clock = LocalClock(lambda: 100.0)
    policy = Policy("pensieve", CostModel.linear(CS), CS, clock)
    return KVCacheManager(gpu, cpu, CS, policy, mode, now=lambda: 100.0)


def tiers(text: str) -> list[str]:
    names = {"g": "gpu", "c": "cpu", "b": "both", "k": "disk", "d": "dropped"}
    return [names.get(x, x) for x in text]


def test_placed_tables_keep_the_layout_and_the_counts():
    m = cache()
    m.place(m.table("a"), tiers("ddccgbg"), 7 * CS - 5)
    m.place(m.table("b"), tiers("cgb"), 3 * CS)
    m.place(m.table("c"), tiers("dd"), 40)
    m.check()
    a = m.tables["a"]
    assert [c.tier for c in a.chunks] == ["dropped"] * 2 + ["cpu"] * 2 + ["gpu"] * 3
    assert (a.n_dropped, a.n_shared, a.n_off_gpu, a.tokens) == (2, 2, 4, 7 * CS - 5)
    assert (a.n_gpu, a.n_backed) == (3, 1)
    assert m.usage("gpu") == (16, 5, 11) and m.usage("cpu") == (8, 5, 3)
    assert m.tiers.reclaimable == 2 and m.tiers.pinned_gpu == 0
    # They are candidates like any other: making room evicts them, and check() holds.
    m.begin_step()
    m.admit(m.table("new"), 0, 16 * CS - 1)  # the whole GPU tier
    assert m.gpu.num_free == 0 and not any(c.gpu for c in a.chunks)
    assert m.counters.swapped_out_tokens + m.counters.dropped_tokens > 0
    m.check()


@pytest.mark.parametrize(
    ("mode", "residency", "why"),
    [
        (CacheMode.PENSIEVE, "gcd", "laid out"),
        (CacheMode.PENSIEVE, "gx", "unknown tier"),
        (CacheMode.PENSIEVE, "kg", "no disk tier"),
        (CacheMode.GPU, "cg", "has none"),
        (CacheMode.GPU, "bg", "has none"),
        (CacheMode.STATELESS, "dc", "has none"),
        (CacheMode.PENSIEVE, "gggggggggggggggggg", "blocks asked"),
    ],
)
def test_a_residency_the_cache_cannot_hold_is_refused(mode, residency, why):
    m = cache(mode)
    with pytest.raises(ValueError, match=why):
        m.place(m.table("a"), tiers(residency), len(residency) * CS)
    assert not m.tables["a"].chunks
    m.check()
    with pytest.raises(ValueError, match="2 tiers for 100 positions"):
        m.place(m.table("b"), tiers("dd"), 100)


# ---- the engine --------------------------------------------------------------------------


def engine(mode="pensieve", **kw) -> Engine:
    config = dict(model="dummy:tiny", device="cpu", gpu_cache_chunks=24, cpu_cache_chunks=12)
    config.update(kw)
    return Engine(EngineConfig(cache_mode=mode, **config))


def stream(n: int, start: int = 10) -> list[int]:
    return [start + i % 200 for i in range(n)]


SP = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize(
    ("mode", "residency", "want"),
    [  # (cached, swapped in, recomputed) of a 7-chunk context of 219 positions
        ("pensieve", "ddccgbg", (219 - 4 * CS, 2 * CS, 2 * CS)),
        ("pensieve", "ccccccc", (0, 219, 0)),
        ("gpu", "dddgggg", (219 - 3 * CS, 0, 3 * CS)),
        ("stateless", "ddddddd", (0, 0, 219)),
    ],
)
def test_the_next_turn_counts_what_the_residency_says(mode, residency, want):
    e = engine(mode)
    tokens = stream(220)  # a turn's end leaves its last token uncomputed: 219 positions
    e.seed([Seed("c", tokens, tiers(residency), e.now() - 30.0, computed=219)])
    e.cache.check()
    snap = {c.id: c for c in e.snapshot().conversations}["c"]
    assert snap.tokens == 220 and list(snap.chunks) == tiers(residency.replace("b", "g"))
    assert 29.0 < snap.idle_s < 60.0
    (r,) = e.run([Turn("c", [5, 6, 7], SP)])
    s = r.stats
    assert (s.cached_tokens, s.swapped_in_tokens, s.recomputed_tokens) == want
    assert len(r.token_ids) == 4
    assert e.streams["c"].length == 220 + 3 + 4  # the stream went on from the seed
    e.cache.check()
    e.close()


def test_a_seed_is_all_or_none_and_only_into_an_idle_engine():
    e = engine("gpu", gpu_cache_chunks=8)
    ok = Seed("a", stream(64), tiers("gg"), e.now())
    with pytest.raises(ValueError, match="'b'.*has none"):
        e.seed([ok, Seed("b", stream(64), tiers("cg"), e.now())])
    with pytest.raises(ValueError, match="GPU and 0 CPU blocks"):
        e.seed([ok, Seed("b", stream(64 * 4), tiers("gggggggg"), e.now())])
    assert not e.streams and not e.cache.held()  # nothing placed
    e.seed([ok])
    with pytest.raises(ValueError, match="held already"):
        e.seed([ok])
    req = e.submit(Turn("x", [1, 2, 3], SP))
    with pytest.raises(ValueError, match="in flight"):
        e.seed([Seed("y", stream(32), tiers("g"), e.now())])
    while req.status != Status.FINISHED:
        e.step()
    e.free("a")
    e.seed([ok])  # freed: seeded again
    e.cache.check()
    e.close()


def test_chunks_on_disk_are_read_back(tmp_path):
    e = engine(disk_cache_dir=str(tmp_path), gpu_cache_chunks=16, cpu_cache_chunks=4)
    e.disk.store.choice = "load"  # read back whatever recomputing would cost
    tokens = stream(6 * CS + 1)
    e.seed([Seed("c", tokens, tiers("dkkcgg"), e.now() - 5.0, computed=6 * CS)])
    assert len(list(tmp_path.rglob("*.kv"))) == 2 and e.snapshot().disk.used == 2
    e.cache.check()
    with pytest.raises(ValueError, match="not full"):
        e.seed([Seed("d", stream(40), tiers("dk"), e.now())])
    (r,) = e.run([Turn("c", [5, 6], SP)])
    s = r.stats
    assert (s.disk_tokens, s.swapped_in_tokens, s.cached_tokens) == (2 * CS, CS, 2 * CS)
    assert s.recomputed_tokens == CS
    e.close()


def test_the_async_front_seeds_on_its_loop():
    async def go() -> tuple:
        front = AsyncEngine(EngineConfig(model="dummy:tiny", device="cpu", gpu_cache_chunks=16))
        await front.start()
        try:
            now = front.engine.now()
            await front.seed([Seed("c", stream(100), tiers("gggg"), now, computed=99)])
            result = await front.generate(Turn("c", [7, 8], SP))
            with pytest.raises(ValueError, match="held already"):
                await front.seed([Seed("c", stream(10), tiers("g"), now)])
            return result.stats.cached_tokens, result.stats.recomputed_tokens
        finally:
            await front.stop()

    assert asyncio.run(go()) == (99, 0)


# ---- real weights ------------------------------------------------------------------------


def test_an_all_dropped_seed_gives_the_replies_of_the_engine_that_ran_the_turns():
    config = dict(
        model="smollm2-135m-instruct", device="cpu", gpu_cache_chunks=32, cpu_cache_chunks=8
    )
    ran, seeded = Engine(EngineConfig(**config)), Engine(EngineConfig(**config))
    tok = ran.tokenizer
    first = tok.encode("Tell me about the moon and the tides, briefly.", add_special_tokens=False)
    second = tok.encode("And about the sun?", add_special_tokens=False)
    sp = SamplingParams(max_tokens=24, temperature=0.0)
    (a,) = ran.run([Turn("c", first, sp)])
    (want,) = ran.run([Turn("c", second, sp)])
    history = first + a.token_ids
    # As a turn leaves it (its last sampled token not computed yet), or all of it computed
    for computed in (len(history) - 1, None):
        cid = f"c{computed}"
        n = -(-(computed or len(history)) // CS)
        seeded.seed([Seed(cid, history, ["dropped"] * n, seeded.now(), computed=computed)])
        (b,) = seeded.run([Turn(cid, second, sp)])
        assert b.stats.recomputed_tokens == (computed or len(history))
        assert b.token_ids == want.token_ids
        seeded.cache.check()
    # A GPU residency whose KV was never computed runs (and counts as cached), but its
    # replies are not the model's: seeding is for measurement.
    n = -(-len(history) // CS)
    seeded.seed([Seed("g", history, ["gpu"] * n, seeded.now())])
    (g,) = seeded.run([Turn("g", second, sp)])
    assert g.stats.cached_tokens == len(history) and g.stats.recomputed_tokens == 0
    ran.close()
    seeded.close()
