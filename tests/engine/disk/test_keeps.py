"""The disk tier's keeps outlive the process: journaled in the tier's directory, read back
(expired keeps and missing keys dropped) by the next tier on it, shared by tiers on one
directory, dropped with a removed chunk, and a damaged journal or a failing disk costs the
durability only."""

from __future__ import annotations

import logging
import time

from engine.disk.files import ChunkFiles
from engine.disk.keeps import NAME
from tests.engine.disk.test_files import KEY, chunk

DAY = 86_400.0


def size() -> int:
    return len(b"".join(p.numpy().tobytes() for p in chunk(0))) + 200  # payload and header


def tier(path, capacity: int = 1 << 30) -> ChunkFiles:
    # later chunks cost more to recompute: unkept, the first ones go first
    return ChunkFiles(path, capacity, "space", cost=lambda context: float(context))


def write(d: ChunkFiles, keys: range) -> None:
    for i in keys:
        d.put(KEY[i], i, chunk(i))
        d.flush()


def test_kept_chunks_outlast_others_after_a_restart(tmp_path):
    d = tier(tmp_path, 4 * size())
    write(d, range(4))
    d.keep([KEY[0], KEY[1]], time.time() + DAY)  # the two of lowest value
    d.close()
    again = tier(tmp_path, 4 * size())  # a new process on the same directory
    assert set(again.kept) == {KEY[0], KEY[1]}
    write(again, range(4, 6))  # over the capacity: two must go
    assert again.evicted > 0
    assert KEY[0] in again.index and KEY[1] in again.index  # kept: not the lowest value first
    assert KEY[2] not in again.index and not again.path(KEY[2], 2).exists()


def test_expired_keeps_and_missing_files_are_dropped_at_start(tmp_path):
    d = tier(tmp_path)
    write(d, range(3))
    d.keep([KEY[0]], time.time() - 1.0 - DAY)  # rounded up by an hour: still expired
    d.keep([KEY[1]], time.time() + DAY)
    d.keep([KEY[7]], time.time() + DAY)  # never written: no file
    d.path(KEY[1], 1).unlink()  # gone meanwhile (a peer evicted it)
    d.keep([KEY[2]], time.time() + DAY)
    again = tier(tmp_path)
    assert set(again.kept) == {KEY[2]}
    lines = (again.dir / NAME).read_text().splitlines()  # compacted: only what is in force
    assert [line.split()[0] for line in lines] == [KEY[2].hex()]


def test_a_removed_chunk_loses_its_keep_durably(tmp_path):
    d = tier(tmp_path)
    write(d, range(2))
    d.keep([KEY[0], KEY[1]], time.time() + DAY)
    d.remove(KEY[0], 0)
    write(d, range(1))  # written again (another chat starts the same way), not kept again
    assert set(d.kept) == {KEY[1]}
    assert set(tier(tmp_path).kept) == {KEY[1]}


def test_tiers_sharing_a_directory_see_each_others_keeps(tmp_path):
    a = tier(tmp_path, 4 * size())
    write(a, range(4))
    a.keep([KEY[0]], time.time() + DAY)
    b = tier(tmp_path, 4 * size())  # a replica started after it
    assert set(b.kept) == {KEY[0]}
    b.keep([KEY[1]], time.time() + DAY)  # after a's start: a reads it when it evicts
    write(a, range(4, 6))
    assert KEY[0] in a.index and KEY[1] in a.index and KEY[2] not in a.index


def test_a_torn_or_garbage_journal_is_read_without_crashing(tmp_path):
    d = tier(tmp_path)
    write(d, range(2))
    d.keep([KEY[0]], time.time() + DAY)
    d.close()
    with open(d.dir / NAME, "ab") as f:
        f.write(b"not a line\nzz 12\n\xff\xfe 1\n" + KEY[1].hex().encode() + b" nan\n")
        f.write(KEY[1].hex().encode() + b" 17")  # cut short by a crash: no newline
    again = tier(tmp_path)
    assert set(again.kept) == {KEY[0]}
    again.keep([KEY[1]], time.time() + DAY)  # appends after the torn tail still count
    assert set(tier(tmp_path).kept) == {KEY[0], KEY[1]}


def test_a_journal_that_cannot_be_written_only_loses_the_durability(tmp_path, caplog):
    d = tier(tmp_path)
    write(d, range(2))
    (d.dir / NAME).unlink(missing_ok=True)
    (d.dir / NAME).mkdir()  # every append now fails
    with caplog.at_level(logging.WARNING, logger="engine.disk.keeps"):
        d.keep([KEY[0]], time.time() + DAY)
        d.keep([KEY[1]], time.time() + DAY)
        d.remove(KEY[1], 1)
    assert set(d.kept) == {KEY[0]}  # kept in memory all the same
    assert sum("not durable" in r.message for r in caplog.records) == 1  # said once
