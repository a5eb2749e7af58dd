"""ChunkFiles alone: files written behind the caller and read back verified, the index rebuilt
at start, capacity kept by retention value, and a disk that refuses writes."""

from __future__ import annotations

import shutil

import torch

from engine.disk.files import ChunkFiles

KEY = [bytes([i]) * 16 for i in range(8)]


def chunk(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, 4, 3, generator=g), torch.randn(2, 2, 4, generator=g).half()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True)
    )


def test_round_trip_and_restart(tmp_path):
    d = ChunkFiles(tmp_path, 1 << 30, "space")
    assert d.put(KEY[0], 0, chunk(0)) and d.has(KEY[0], 0)
    d.flush()
    assert same(d.read(KEY[0], 0), chunk(0))
    assert not d.put(KEY[0], 0, chunk(0))  # stored once
    again = ChunkFiles(tmp_path, 1 << 30, "space")  # a new process: the index from the files
    assert KEY[0] in again.index and again.bytes == d.bytes
    assert same(again.read(KEY[0], 0), chunk(0))
    assert again.read(KEY[1], 1) is None


def test_a_chunk_queued_for_writing_reads_back_at_once(tmp_path):
    d = ChunkFiles(tmp_path, 1 << 30, "space")
    with d.lock:  # the writer cannot take it yet
        d.pending[KEY[2]] = chunk(2)
    assert d.has(KEY[2], 2) and same(d.read(KEY[2], 2), chunk(2))


def test_over_capacity_the_lowest_value_goes(tmp_path):
    size = len(b"".join(p.numpy().tobytes() for p in chunk(0))) + 200  # payload and header
    d = ChunkFiles(tmp_path, 4 * size, "space", cost=lambda context: float(context))
    for i in range(6):  # later chunks cost more to recompute: the first ones go
        d.put(KEY[i], i, chunk(i))
        d.flush()
    assert d.evicted > 0 and d.bytes <= 4 * size
    assert KEY[0] not in d.index and KEY[5] in d.index
    assert not d.path(KEY[0], 0).exists()


def test_a_disk_that_refuses_writes_stops_writing(tmp_path):
    d = ChunkFiles(tmp_path / "kv", 1 << 30, "space")
    shutil.rmtree(d.dir)
    d.dir.parent.mkdir(exist_ok=True)
    d.dir.write_text("not a directory")  # every write now fails
    assert d.put(KEY[3], 3, chunk(3))
    d.flush()
    assert not d.writable and d.failed == 1
    assert not d.put(KEY[4], 4, chunk(4))  # nothing more is queued
    assert d.read(KEY[3], 3) is None


def test_the_cost_rule_reads_only_what_is_cheaper(tmp_path):
    d = ChunkFiles(tmp_path, 1 << 30, "space", cost=lambda context: context * 1e-3, chunk_size=32)
    for i in range(4):
        d.put(KEY[i], i, chunk(i))
    d.flush()
    d.read_bps = 1e6  # 0.05 s to read 50 kB: chunks 0 (0.032 s) and 1 (0.064 s)... recompute
    loaded = d.load(KEY[:4], 4, 50_000)
    assert (loaded.first, loaded.last) == (1, 4) and set(loaded.parts) == {1, 2, 3}
    d.choice = "recompute"
    assert d.load(KEY[:4], 4, 50_000) is None
    d.choice = "load"
    assert d.load(KEY[:4], 4, 50_000).first == 0
    d.path(KEY[2], 2).write_bytes(b"PKV1 cut short")  # damaged: recompute up to it
    d.choice = "cost"
    assert d.load(KEY[:4], 4, 50_000).first == 3


def test_removed_chunks_are_gone_queued_or_written(tmp_path):
    d = ChunkFiles(tmp_path, 1 << 30, "space")
    d.put(KEY[5], 5, chunk(5))
    d.flush()
    with d.lock:  # queued, the writer not there yet
        d.pending[KEY[6]] = chunk(6)
    d.remove(KEY[5], 5)
    d.remove(KEY[6], 6)
    assert not d.has(KEY[5], 5) and not d.has(KEY[6], 6) and d.bytes == 0


def test_strided_parts_of_every_width_round_trip(tmp_path):
    """bfloat16, float8 and float32 parts that are views with strides come back equal (their
    bytes are taken by numpy, `raw_bytes`: no torch copy on the writer thread)."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(4, 6, 8, generator=g)
    parts = [
        base.to(torch.bfloat16).transpose(0, 1),
        base.to(torch.float8_e4m3fn)[:, ::2],
        base.transpose(1, 2),
    ]
    assert not any(p.is_contiguous() for p in parts)
    d = ChunkFiles(tmp_path, 1 << 30, "space")
    assert d.put(KEY[0], 0, parts)
    d.flush()
    got = d.read(KEY[0], 0)
    assert [p.shape for p in got] == [p.shape for p in parts]
    assert all(
        x.view(torch.uint8).equal(y.contiguous().view(torch.uint8))
        for x, y in zip(got, parts, strict=True)
    )
