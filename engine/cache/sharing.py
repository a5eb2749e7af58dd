"""Shared prefixes: chunks several conversations hold, published and linked by hash chain,
reference-counted by their holders.

When a conversation's first turn ends, the full chunks of its first prompt are published
under a hash chain (`chain_hashes`); a conversation that starts with the same tokens links
them instead of computing them (`link`), and one that computed them anyway hands its copy
back (`publish`). A shared chunk is one `Chunk` held by every holder at the same index,
never written again (it is full), pinned while any holder runs, an eviction candidate of
its own whose value is the sum of its holders' values, and freed when its last holder lets
go. A holder lets go of its whole shared run when it must recompute (it has dropped chunks
before it, or the run must give way to a dropped private chunk after it), and of the run's
tail when it is cut back (truncation). Each table stays laid out [dropped | shared | CPU |
GPU].
"""

from __future__ import annotations

import hashlib
from array import array

from engine.cache.chunks import Chunk, ChunkTable
from engine.cache.order import EvictionOrder
from engine.cache.tiers import Tiers
from engine.cache.to_disk import Spills
from engine.snapshot import EngineCounters


def chain_hashes(tokens: list[int], chunk_size: int, prev: bytes = b"") -> list[bytes]:
    """Hash of each full chunk of `tokens`, chained: equal hashes mean equal tokens at
    equal positions from position 0 on."""
    out = []
    for start in range(0, len(tokens) - chunk_size + 1, chunk_size):
        chunk = array("q", tokens[start : start + chunk_size]).tobytes()
        prev = hashlib.blake2b(prev + chunk, digest_size=16).digest()
        out.append(prev)
    return out


class Sharing:
    def __init__(
        self,
        share: bool,
        chunk_size: int,
        shared: dict[Chunk, None],
        tiers: Tiers,
        order: EvictionOrder,
        spills: Spills,
        counters: EngineCounters,
    ) -> None:
        self.share = share
        self.chunk_size = chunk_size
        self.shared = shared  # every live shared chunk
        self.index: dict[bytes, Chunk] = {}  # hash chain -> shared chunk that can be linked
        self.tiers, self.order, self.spills, self.counters = tiers, order, spills, counters

    def link(self, t: ChunkTable, hashes: list[bytes]) -> int:
        """A conversation starts (its table is empty) with chunks whose hash chain is
        `hashes`: hold the shared chunks that have it, from position 0 on. Returns how many
        positions they hold (their KV is computed)."""
        if not self.share or t.chunks or t.pinned:
            return 0
        for j, key in enumerate(hashes):
            c = self.index.get(key)
            if c is None or c.parent is not (t.chunks[j - 1] if j else None):
                break
            c.holders[t] = None  # type: ignore[index]
            t.chunks.append(c)
            self.order.changed(c)  # one more holder: it is worth more
        t.n_dropped = 0
        t.n_shared = t.n_off_gpu = len(t.chunks)
        self.tiers.touch(t)
        t.tokens = len(t.chunks) * self.chunk_size
        self.counters.shared_tokens += t.tokens
        return t.tokens

    def publish(self, t: ChunkTable, hashes: list[bytes]) -> None:
        """The chunks with hash chain `hashes` (full, their KV computed) may be linked by
        other conversations. One that is already published (computed twice, e.g. by
        conversations that started together) is given up for the published one."""
        if not self.share or t.pinned or t.n_dropped:
            return
        n = min(len(hashes), t.tokens // self.chunk_size, len(t.chunks))
        for j in range(t.n_shared, n):
            parent = t.chunks[j - 1] if j else None
            c, key = t.chunks[j], hashes[j]
            x = self.index.get(key)
            if x is not None and x.parent is parent:
                self._adopt(t, j, x)
                continue
            if x is not None:  # another chain under the same hash (its start was dropped)
                x.key = None
            self.tiers.account(t, c, -1)
            c.holders, c.index, c.key, c.parent, c.pins = {t: None}, j, key, parent, 0
            self.tiers.account(t, c, 1)
            self.shared[c] = None
            self.order.changed(c)
            self.index[key] = c
            t.n_shared = j + 1
            t.n_off_gpu = max(t.n_off_gpu, j + 1)
        self.order.changed(t)

    def _adopt(self, t: ChunkTable, j: int, x: Chunk) -> None:
        """Replace the table's private chunk j by the shared chunk `x` (same tokens), giving
        `x` its blocks where it lacks them and freeing the rest."""
        c = t.chunks[j]
        self.tiers.account(t, c, -1)
        self.tiers.account(t, x, -1)
        if x.gpu is None and c.gpu is not None:
            x.gpu, c.gpu = c.gpu, None
        if x.cpu is None and c.cpu is not None:
            x.cpu, c.cpu = c.cpu, None
        self.tiers.account(t, x, 1)
        for block, pool in ((c.gpu, self.tiers.gpu), (c.cpu, self.tiers.cpu)):
            if block is not None:
                pool.release(block)
        c.gpu = c.cpu = None
        x.holders[t] = None  # type: ignore[index]
        t.chunks[j] = x
        t.n_shared = j + 1
        t.n_off_gpu = max(t.n_off_gpu, j + 1)
        self.order.changed(x)

    def let_go(self, t: ChunkTable, spill: bool = False) -> None:
        """The table stops holding its shared run: those positions count as dropped.
        `spill`: by eviction (a chunk freed with it goes to the disk tier)."""
        for j in range(t.n_dropped, t.n_shared):
            c = t.chunks[j]
            t.chunks[j] = Chunk()
            if self._unref(t, c, spill):
                self.counters.dropped_tokens += self.chunk_size
        t.n_dropped = t.n_shared
        self.order.changed(t)

    def free_chunk(self, t: ChunkTable, c: Chunk) -> None:
        """The table gives up chunk `c`: a private one's blocks are freed, a shared one
        loses `t` as a holder."""
        if c.shared:
            self._unref(t, c)
        else:
            self.tiers.clear(t, c)

    def _unref(self, t: ChunkTable, c: Chunk, spill: bool = False) -> bool:
        """`t` no longer holds shared chunk `c`; free it if it was the last. True if freed."""
        if t.pinned:
            self.tiers.pin_shared(c, -1)
        del c.holders[t]  # type: ignore[arg-type]
        self.tiers.touch(t)
        if c.holders:
            self.order.changed(c)  # fewer holders: it is worth less
            return False
        if spill:
            self.spills.spill(t, c.index, c)
        self._free(c)
        return True

    def drop(self, c: Chunk) -> None:
        """Free shared chunk `c` that has no copy left to keep (no holder is running)."""
        if c.parent is None:  # the first chunk all its holders hold: only it is dropped
            k = c.index
            self.spills.spill(next(iter(c.holders)), k, c)  # type: ignore[arg-type]
            for h in list(c.holders):  # type: ignore[arg-type]
                self.tiers.touch(h)
                h.chunks[k] = Chunk()
                h.n_dropped = k + 1
                if k + 1 < h.n_shared:
                    h.chunks[k + 1].parent = None  # now the first held chunk of its holders
                self.order.changed(h)
            c.holders = {}
            self._free(c)
            self.counters.dropped_tokens += self.chunk_size
        else:  # chunks before it are held: its holders let go of their shared runs
            for h in list(c.holders):  # type: ignore[arg-type]
                self.let_go(h, spill=True)

    def _free(self, c: Chunk) -> None:
        """A shared chunk no one holds: its blocks and its index entry go."""
        self.tiers.clear(None, c)
        if c.key is not None and self.index.get(c.key) is c:
            del self.index[c.key]
        del self.shared[c]

    def check(self, tables: list[ChunkTable]) -> None:
        """Assert that shared chunks are held by exactly the tables that list them, pinned by
        those running, chained to the chunk before them, and findable under their key."""
        held: dict[Chunk, list[ChunkTable]] = {}
        for t in tables:
            for c in t.shared_run():
                held.setdefault(c, []).append(t)
        assert set(held) == set(self.shared), "shared chunks held and registered differ"
        for c, ts in held.items():
            assert c.holders is not None and set(c.holders) == set(ts), "holders drifted"
            assert len(c.holders) == len(ts), "a holder lists it twice"
            assert c.key is None or self.index.get(c.key) is c, "stale key"
            assert c.pins == sum(1 for t in ts if t.pinned), "pins drifted"
            if c.parent is None:  # the first chunk each holder holds
                assert all(t.n_dropped == c.index for t in ts), (c.index, "parent")
            else:
                assert all(t.chunks[c.index - 1] is c.parent for t in ts), (c.index, "chain")
        for key, c in self.index.items():
            assert c.key == key and c in self.shared, "index entry of a dead chunk"
