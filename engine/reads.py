"""History reads of queued turns, off the step loop: the raw tokens a turn needs to recompute
its dropped chunks (from the `TokenHistory`, SQL in the server), and, with a disk tier, the
dropped chunks it can read back instead.

The scheduler never reads: it says which turns it found without their history (`StepPlan
.reads`) and the engine starts those reads here after the step is planned. Before the next
plan, `collect` puts finished reads on their turns (`Request.prefix`, `.loaded`, or
`.error`) and reads what needs no I/O at once (a history the engine keeps in memory).
"""

from __future__ import annotations

from engine.backends.base import Backend
from engine.cache.manager import KVCacheManager
from engine.disk.index import Loaded
from engine.disk.tier import DiskTier
from engine.persistence import TokenHistory
from engine.plan import Read
from engine.request import Request


class Reads:
    def __init__(
        self,
        backend: Backend,
        history: TokenHistory,
        in_memory: bool,
        cache: KVCacheManager,
        disk: DiskTier | None = None,
    ) -> None:
        self.backend = backend
        self.history = history
        self.in_memory = in_memory  # the engine's own history: reading it is no I/O
        self.cache = cache
        self.disk = disk

    def collect(self, queued: list[Request]) -> None:
        """Before planning: finished reads onto their turns; a turn that has not asked yet
        and needs no I/O (the history in memory, nothing the disk tier could give) is read
        now."""
        for req in queued:
            if req.fetch is not None:
                if req.fetch.done():
                    self._finish(req)
            elif req.prefix is None and req.error is None and self._at_hand(req):
                self.start([Read(req, 0)])

    def _finish(self, req: Request) -> None:
        fut, req.fetch = req.fetch, None
        error = fut.exception()
        if error is not None:
            req.error = error
        else:
            req.prefix, req.loaded = fut.result()

    def _at_hand(self, req: Request) -> bool:
        """Its read is no I/O: the history is in memory and the disk tier has nothing to
        give it."""
        return self.in_memory and not self.cache.loadable(req.table)

    def start(self, reads: list[Read]) -> None:
        """Start the reads a plan asked for (a history in memory: read now)."""
        for read in reads:
            req = read.req
            req.read_for = read.dropped
            if self.in_memory and not read.dropped:
                try:
                    req.prefix = self.history.read(req.state.id, 0, req.base)
                except Exception as e:
                    req.error = e
                continue
            args = (req.state.id, req.base, read.dropped, req.prefix)
            store = self.disk.store if self.disk is not None else None  # a simulation times it
            req.fetch = self.backend.read_later(store, self.read_back, *args)

    def pending(self, queued: list[Request]) -> list:
        return [r.fetch for r in queued if r.fetch is not None]

    def read_back(
        self, cid: str, base: int, dropped: int, prefix: list[int] | None = None
    ) -> tuple[list[int], Loaded | None]:
        """Off the step loop: the history [0, base) (unless `prefix` holds it), and the last
        chunks of a dropped run of `dropped` chunks from the disk tier where that is cheaper
        than recomputing them."""
        if prefix is None or len(prefix) < base:
            prefix = self.history.read(cid, 0, base)
        if not dropped or self.disk is None:
            return prefix, None
        loaded = self.disk.load(prefix, dropped, base)
        if loaded is not None:  # on CUDA page-locked: copied layer by layer, async
            loaded.parts = self.backend.pin(loaded.parts)
        return prefix, loaded
