"""Sliding layers' pages (engine/kv_layout.py): which chunks the window still reads, freeing
the pages of those it has left, and what a chunk read back from disk must hold.

A chunk inside the window holds every group's pages on its tier, one after it (`Tiers`).
Without sliding groups every answer here is the trivial one: every chunk is read, none is
freed, every file will do.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.cache.chunks import ChunkTable
from engine.cache.tiers import Tiers
from engine.kv_layout import KVLayout


class Windows:
    def __init__(self, layout: KVLayout | None, chunk_size: int, tiers: Tiers) -> None:
        # None: one group (a block holds every layer), nothing to free
        self.layout = layout if layout is not None and layout.windowed else None
        self.chunk_size = chunk_size
        self.tiers = tiers

    def first(self, position: int) -> int:
        """The first chunk sliding layers read from queries at `position` on (0: every one)."""
        return 0 if self.layout is None else self.layout.first_read(position, self.chunk_size)

    def kept_from(self, tokens: int) -> int:
        """The first chunk that keeps its sliding pages in a table of `tokens` positions: the
        window of its last chunk's start, not of `tokens` (a recompute after chunks read back
        from disk starts there at the latest: `loads_hold_pages`)."""
        return self.first(tokens - tokens % self.chunk_size)

    def slide(self, t: ChunkTable, position: int) -> None:
        """The table's sliding layers will read nothing before `kept_from(position)` (a
        turn's computed length, or its length before a step in flight that may be taken
        back): the chunks before it give up their sliding groups' pages, for good."""
        if self.layout is None:
            return
        first = min(self.kept_from(position), len(t.chunks))
        for c in t.chunks[t.slid : first]:
            if c.gpu_win is not None or c.cpu_win is not None:
                self.tiers.unwindow(None if c.shared else t, c)
        t.slid = max(t.slid, first)

    def moves_back(self, t: ChunkTable, length: int) -> bool:
        """Cut to `length` positions, the window would read chunks that gave up their
        sliding pages: they must be recomputed."""
        return self.kept_from(length) < t.slid

    def loads_hold_pages(
        self, t: ChunkTable, span: tuple[int, int], kv_len: int, pages: Callable[[int], int | None]
    ) -> bool:
        """Can chunks [first, last) of the dropped run come from the disk tier: each of them
        a sliding layer reads again (in the window of the recompute after them, or of the
        turn's next position) must hold its sliding pages in its file (`pages(i)`: the pages
        chunk i's file holds; None: unknown, a simulated tier's). A file written by another
        conversation whose window had left the chunk holds one."""
        if self.layout is None:
            return True
        first, last = span
        cs = self.chunk_size
        after = last * cs if min(kv_len, t.n_dropped * cs) > last * cs else kv_len
        wanted = range(max(first, self.kept_from(after)), last)
        return all(pages(i) in (None, self.layout.groups) for i in wanted)

    def check(self, t: ChunkTable) -> None:
        """An idle table's chunks that its window reads hold their sliding pages."""
        if self.layout is None or t.pinned:
            return
        for i in range(self.kept_from(t.tokens), len(t.chunks)):
            c = t.chunks[i]
            assert c.gpu is None or c.gpu_win is not None, (t.id, i, "window lost")
            assert c.cpu is None or c.cpu_win is not None, (t.id, i, "window lost")
