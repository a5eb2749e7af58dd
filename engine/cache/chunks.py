"""Where a conversation's KV lives: its chunks and their tiers, in a table written by the
cache only. (Its token stream is the other record, `engine/stream.py`, written by the
engine only.)"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

GPU, CPU, DROPPED = "gpu", "cpu", "dropped"
# A seeded residency (`KVCacheManager.place`) also names a GPU chunk with a CPU copy, and a
# dropped chunk the disk tier holds
BOTH, DISK = "both", "disk"
RESIDENCIES = (GPU, CPU, BOTH, DISK, DROPPED)


@dataclass(eq=False)
class Chunk:
    """`chunk_size` consecutive token positions. A chunk on the GPU may keep a CPU copy
    (written ahead of time, or left by a swap-in) so that its GPU block can be reclaimed
    for free; a chunk with neither is dropped and is recomputed from raw history.

    A shared chunk (`holders` set) is a full chunk of a conversation's first prompt whose
    tokens and positions other conversations have too: one object, held at the same index
    by each of its holders, never written again, freed when its last holder lets go."""

    gpu: int | None = None
    cpu: int | None = None
    holders: dict[ChunkTable, None] | None = None  # None: private to one table
    index: int = 0  # its position in every holder's table (shared chunks only)
    key: bytes | None = None  # its hash chain in the prefix index; None: not findable
    # The shared chunk before it in every holder; None at index 0 or once that one was
    # dropped (then it is the first chunk its holders still hold).
    parent: Chunk | None = None
    pins: int = 0  # holders running a turn: it stays on the GPU while this is not 0
    prefetched: bool = False  # brought back to the GPU by a prefetch, not yet used by a turn
    ahead: bool = False  # its CPU copy was made ahead of time and has not been read back
    # With sliding layers (engine/kv_layout.py), the pages of their groups on each tier, held
    # while the chunk is inside the window; None: it holds its full layers' page only
    gpu_win: tuple[int, ...] | None = None
    cpu_win: tuple[int, ...] | None = None

    def gpu_pages(self) -> tuple[int, ...]:
        """Every page it holds on the GPU, its full layers' first (empty: none)."""
        return () if self.gpu is None else (self.gpu, *(self.gpu_win or ()))

    def cpu_pages(self) -> tuple[int, ...]:
        return () if self.cpu is None else (self.cpu, *(self.cpu_win or ()))

    @property
    def shared(self) -> bool:
        return self.holders is not None

    @property
    def tier(self) -> str:
        return GPU if self.gpu is not None else CPU if self.cpu is not None else DROPPED


@dataclass(eq=False)
class ChunkTable:
    """Where a conversation's KV lives. Written by `KVCacheManager` (and its parts) only."""

    id: str
    chunks: list[Chunk] = field(default_factory=list)
    # Layout [dropped | shared | CPU | GPU]: chunks [0, n_dropped) hold nothing, chunks
    # [n_dropped, n_shared) are shared (each on the GPU or the CPU, moved by the cache as
    # one), chunks [n_shared, n_off_gpu) only a CPU copy, the rest a GPU block.
    n_dropped: int = 0
    n_shared: int = 0
    n_off_gpu: int = 0
    tokens: int = 0  # positions the chunks stand for (their KV is held, or was dropped)
    pinned: bool = False  # a turn of it is running: none of its chunks may be evicted
    n_gpu: int = 0  # GPU pages of its private chunks
    n_backed: int = 0  # of those, the pages of chunks with a CPU copy (reclaimable at no cost)
    # Chunks before it hold no sliding pages: the window has passed them (`slide`)
    slid: int = 0
    # Where every layer slides (engine/kv_layout.py `gone`): chunks before it hold nothing and
    # are needed by no later query, as long as the chunks after them are held; a part of the
    # dropped run (gone <= n_dropped). Once a chunk after them is lost, the recompute runs
    # from position 0 again (a sliding layer's KV depends on every position before it).
    gone: int = 0
    # While pinned, its chunks keep their GPU blocks and only more are added: the block ids
    # read so far, each once per pin (`Tiers.set_pinned` resets it), not once per step
    gpu_ids: array | None = field(default=None, repr=False)

    @property
    def missing(self) -> bool:
        """Some dropped chunk must come back (from disk, or recomputed) for the next turn."""
        return self.n_dropped > self.gone

    def tiers(
        self, hashes: list[bytes] = (), on_disk: set[bytes] | frozenset = frozenset()
    ) -> list[str]:
        """Each chunk's tier; a dropped chunk whose hash (`hashes`, the stream's) the disk
        tier holds (`on_disk`) is on "disk"."""
        tiers = [c.tier for c in self.chunks]
        for j in range(min(self.n_dropped, len(hashes)) if on_disk else 0):
            if hashes[j] in on_disk:
                tiers[j] = "disk"
        return tiers

    def gpu_blocks(self, n_chunks: int) -> array:
        """The GPU blocks of its first `n_chunks` chunks (int32). Called per piece per step:
        a running turn's are read from the chunks once, then only the new ones."""
        ids = self.gpu_ids if self.pinned else None
        if ids is None:
            ids = array("i")
            if self.pinned:
                self.gpu_ids = ids
        if len(ids) < min(self.gone, n_chunks):  # never read: before every layer's window
            ids.extend(array("i", bytes(4 * (min(self.gone, n_chunks) - len(ids)))))
        if len(ids) < n_chunks:
            new = [c.gpu for c in self.chunks[len(ids) : n_chunks]]
            if len(ids) + len(new) < n_chunks or None in new:  # C-speed scan
                raise RuntimeError(f"conversation {self.id!r} has chunks off the GPU while running")
            ids.extend(new)  # type: ignore[arg-type]
        return ids[:n_chunks]

    def window_blocks(self, n_chunks: int, groups: int) -> list[list[int]]:
        """Per sliding group (1 .. groups - 1), the GPU pages of its first `n_chunks` chunks;
        page 0 for those the window has left (never read: the kernels skip keys before it)."""
        out = [[0] * n_chunks for _ in range(groups - 1)]
        for i in range(min(self.slid, n_chunks), n_chunks):
            pages = self.chunks[i].gpu_win
            if pages is not None:
                for g, page in enumerate(pages):
                    out[g][i] = page
        return out

    def shared_run(self) -> list[Chunk]:
        return self.chunks[self.n_dropped : self.n_shared]

    def check(self, chunk_size: int) -> None:
        """Assert the layout [dropped | shared | CPU | GPU], and that it covers its tokens."""
        n_dropped, n_shared, n_off_gpu = self.n_dropped, self.n_shared, self.n_off_gpu
        assert 0 <= n_dropped <= n_shared <= n_off_gpu <= len(self.chunks), self
        assert self.gone <= n_dropped, (self.id, "gone chunks outside the dropped run")
        assert len(self.chunks) >= -(-self.tokens // chunk_size) or self.pinned, self
        full = n_shared == n_dropped or n_shared * chunk_size <= self.tokens
        assert full, (self.id, "a shared chunk that is not full")
        if self.gpu_ids is not None:
            assert self.pinned, (self.id, "block ids kept while not running")
            held = [c.gpu or 0 for c in self.chunks[: len(self.gpu_ids)]]
            assert list(self.gpu_ids) == held, (self.id, "block ids kept went stale")
        for i, c in enumerate(self.chunks):
            if n_dropped <= i < n_shared:
                assert c.shared and c.index == i, (self.id, i, "should be shared")
                assert c.gpu is not None or c.cpu is not None, (self.id, i, "shared, empty")
                assert c.gpu is not None or not self.pinned, (self.id, i, "running, off GPU")
                continue
            assert not c.shared, (self.id, i, "shared outside the shared run")
            both = c.gpu_win is not None and c.cpu is not None
            assert not both or c.cpu_win is not None, (self.id, i, "a CPU copy, no sliding pages")
            if i < self.slid:
                assert c.gpu_win is None and c.cpu_win is None, (self.id, i, "slid past")
            if i < n_dropped:
                assert c.gpu is None and c.cpu is None, (self.id, i, "should be dropped")
            elif i < n_off_gpu:
                assert c.gpu is None and c.cpu is not None, (self.id, i, "should be on CPU")
            else:
                assert c.gpu is not None, (self.id, i, "should be on GPU")
