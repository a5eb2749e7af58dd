"""The disk tier of a simulated device: the real tier's index and eviction with no files,
its time from the device's drive, and an engine that reads dropped chunks back from it."""

from __future__ import annotations

import random
from dataclasses import asdict

import pytest

from engine import Engine, EngineConfig, SamplingParams, Turn
from engine.copies import CopyPlan
from engine.disk.index import QUEUE
from engine.sim.clock import VirtualClock
from engine.sim.devices import Disk
from engine.sim.disk import SimDisk
from tests.engine.sim.test_runtime import pool

KEY = [bytes([i]) * 16 for i in range(8)]
DRIVE = Disk(read_bps=1000.0, write_bps=500.0, source="test")
MODEL = "dummy:llama-2-13b-gqa10"


def disk(capacity_chunks: float = 100) -> tuple[SimDisk, VirtualClock]:
    clock = VirtualClock()
    return SimDisk(DRIVE, clock, int(capacity_chunks * 100), 100, lambda n: float(n)), clock


def test_over_capacity_the_lowest_value_goes() -> None:
    d, clock = disk(capacity_chunks=4)
    for i in range(6):  # later chunks cost more to recompute: the first ones go
        clock.advance(1.0)
        assert d.put(KEY[i], i, [])
    assert d.evicted == 2 and d.bytes <= 4 * 100
    assert KEY[0] not in d.index and KEY[1] not in d.index and KEY[5] in d.index
    assert not d.put(KEY[5], 5, [])  # stored once
    d.remove(KEY[5], 5)
    assert not d.has(KEY[5], 5) and d.bytes == 3 * 100


def test_a_long_idle_chunk_goes_before_a_cheaper_recent_one() -> None:
    d, clock = disk(capacity_chunks=2.5)  # an eviction round frees one chunk
    d.put(KEY[3], 3, [])
    clock.advance(100.0)
    d.put(KEY[0], 0, [])
    d.put(KEY[1], 1, [])
    assert KEY[3] not in d.index and {KEY[0], KEY[1]} <= d.index.keys()


def test_one_drive_reads_first_and_drops_writes_past_the_queue() -> None:
    d, clock = disk(capacity_chunks=2 * QUEUE)  # a chunk: 0.1 s to read, 0.2 s to write
    assert d.read(KEY[0], 0) is None and d.read_until == 0.0  # not held: nothing read
    for i in range(QUEUE):
        assert d.put(i.to_bytes(16, "big"), i, [])
    assert not d.put(KEY[7], 7, []) and d.skipped == 1  # the writer is QUEUE chunks behind
    assert d.write_until == pytest.approx(QUEUE * 0.2)
    clock.advance(0.2)  # the first write has landed: room for one more
    assert d.put(KEY[7], 7, [])
    assert d.read(KEY[7], 7) == [] and d.read(KEY[7], 7) == []
    assert d.read_until == pytest.approx(0.2 + 2 * 0.1) and d.reads == 2
    assert d.read_s(100) == pytest.approx(0.1)
    # The queued writes waited for the reads: the next to land, due at 0.4, lands at 0.6.
    assert d.write_until == pytest.approx(QUEUE * 0.2 + 0.2 + 2 * 0.1)
    clock.advance(0.35)
    assert not d.put(KEY[6], 6, [])
    clock.advance(0.1)
    assert d.put(KEY[6], 6, [])


def test_loads_are_copied_beside_the_forward_like_a_swap_in() -> None:
    times = []
    for plan in (CopyPlan(swap_in=[(0, 0), (1, 1)]), CopyPlan(load=[([], (0,)), ([], (1,))])):
        p, clock = pool()
        p.begin_step(plan)
        p.run(0.5)
        times.append(clock())
    assert times[0] == times[1] == pytest.approx(2.0)  # a 2 s copy beside a 0.5 s forward
    p, clock = pool()
    assert p.read_pages("cpu", (3,)) == [] and p.read_pages("gpu", (4,)) == []
    p.begin_step(CopyPlan())  # the GPU block's copy to the host (2 s) before the forward
    p.run(0.5)
    assert clock() == pytest.approx(2.5)


def run(**kw) -> tuple[Engine, list]:
    """Conversations longer than both tiers, three turns each, one after the other."""
    cfg = dict(model=MODEL, device="sim:h100", gpu_cache_chunks=120, cpu_cache_chunks=60)
    engine = Engine(EngineConfig(**(cfg | kw)))
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    out = []
    for t in range(3):
        for i in range(6):
            prompt = [rng.randrange(1, 30000) for _ in range(rng.randrange(300, 900))]
            [res] = engine.run([Turn(f"c{i}", prompt, sp)])
            out.append((t, i, res.stats.disk_tokens, res.stats.first_token_s, res.stats.finish_s))
    return engine, out


def test_dropped_chunks_come_back_from_the_simulated_disk(tmp_path) -> None:
    where = tmp_path / "never-made"
    engine, out = run(disk_cache_dir=str(where), disk_cache_gb=5)
    c = engine.snapshot().counters
    assert c.spilled_tokens > 0 and c.disk_tokens > 0
    assert sum(o[2] for o in out) == c.disk_tokens
    assert engine.disk.store.reads > 0 and engine.disk.store.read_until > 0
    assert not where.exists()  # no files
    engine.cache.check()
    plain, _ = run()
    p = plain.snapshot().counters
    assert p.disk_tokens == 0
    # Read back instead of recomputed: less recompute, and less virtual time in all.
    assert c.recomputed_tokens < p.recomputed_tokens
    assert engine.now() < plain.now()
    snap = engine.snapshot()
    assert snap.disk is not None and snap.disk.used > 0


def test_a_disk_run_is_deterministic() -> None:
    runs = []
    for _ in range(2):
        engine, out = run(disk_cache_dir="x", disk_cache_gb=5)
        runs.append((out, asdict(engine.snapshot().counters), engine.disk.stats()))
    assert runs[0] == runs[1]
