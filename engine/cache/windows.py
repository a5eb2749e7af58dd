"""Sliding layers' pages (engine/kv_layout.py): which chunks the window still reads, freeing
the pages of those it has left, and what a chunk read back from disk must hold.

A chunk inside the window holds every group's pages on its tier, one after it (`Tiers`).
Where every layer slides (`KVLayout.gone`) a chunk after it holds nothing: it joins the
table's dropped run as `gone`, needed again only by a recompute from position 0. Without a
window every answer here is the trivial one: every chunk is read, none is freed, every file
will do.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.cache.chunks import ChunkTable
from engine.cache.tiers import Tiers
from engine.kv_layout import KVLayout


class Windows:
    def __init__(self, layout: KVLayout | None, chunk_size: int, tiers: Tiers) -> None:
        # None: no window (a block holds every layer), nothing to free
        kept = layout is not None and (layout.windowed or layout.gone)
        self.layout = layout if kept else None
        self.gone = kept and layout.gone  # every layer slides: chunks it left hold nothing
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
        if self.gone:
            self._let_go(t, first)
            return
        for c in t.chunks[t.slid : first]:
            if c.gpu_win is not None or c.cpu_win is not None:
                self.tiers.unwindow(None if c.shared else t, c)
        t.slid = max(t.slid, first)

    def _let_go(self, t: ChunkTable, first: int) -> None:
        """Every layer slides: chunks [gone, first) are freed on every tier and join the
        dropped run (never spilled: nothing reads them while the chunks after them are held)."""
        if first <= t.gone:
            return
        for c in t.chunks[t.gone : first]:
            if c.cpu is not None:
                self.tiers.clear_cpu(t, c, stale=True)  # this step's swap-in may read it
            if c.gpu is not None:
                self.tiers.clear_gpu(t, c)
        t.gone = t.slid = first
        t.n_dropped = max(t.n_dropped, first)
        t.n_shared = max(t.n_shared, first)
        t.n_off_gpu = max(t.n_off_gpu, first)
        t.gpu_ids = None  # a running turn's block ids: read again (`ChunkTable.gpu_blocks`)
        if not t.pinned:
            self.tiers.order.changed(t)

    def gone_before(self, tokens: int) -> int:
        """Where every layer slides, the chunks a table of `tokens` positions needs not
        hold (`ChunkTable.gone`): those before its window; else 0."""
        return self.kept_from(tokens) if self.gone else 0

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
        """An idle table's chunks that its window reads hold their pages."""
        if self.layout is None or t.pinned:
            return
        if self.gone:  # nothing is gone that a later query reads
            assert t.gone <= self.kept_from(t.tokens), (t.id, t.gone, "gone inside the window")
            return
        for i in range(self.kept_from(t.tokens), len(t.chunks)):
            c = t.chunks[i]
            assert c.gpu is None or c.gpu_win is not None, (t.id, i, "window lost")
            assert c.cpu is None or c.cpu_win is not None, (t.id, i, "window lost")
