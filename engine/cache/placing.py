"""A seeded state (engine/seed.py): a conversation's chunks placed in the tiers given, through
the tiers' own accounting, whose KV is whatever the blocks hold. `KVCacheManager` is the
facade over it."""

from __future__ import annotations

from collections.abc import Sequence

from engine.cache.chunks import BOTH, CPU, DISK, DROPPED, GPU, RESIDENCIES, Chunk, ChunkTable
from engine.cache.order import EvictionOrder
from engine.cache.tiers import Tiers
from engine.cache.to_disk import Spills
from engine.cache.windows import Windows


class Placer:
    """Holds no state of its own: the tiers and parts are the manager's."""

    def __init__(
        self,
        chunk_size: int,
        mode: str,
        tiers: Tiers,
        order: EvictionOrder,
        spills: Spills,
        windows: Windows,
    ) -> None:
        self.chunk_size, self.mode = chunk_size, mode
        self.tiers, self.order, self.spills, self.windows = tiers, order, spills, windows

    def blocks(self, tiers: Sequence[str], tokens: int) -> tuple[int, int]:
        """The GPU and CPU blocks (pages: a chunk inside the window holds every group's)
        `place` takes for this residency. ValueError where this cache cannot hold it: not
        one tier of `RESIDENCIES` per chunk of `tokens` positions,
        a layout other than [dropped or disk | cpu | gpu or both], a tier its mode lacks (a
        CPU tier in gpu-only and stateless mode), a chunk on disk without a disk tier or not
        full. (A stateless cache holds GPU chunks only while a turn runs: seeded, they stand
        for a turn that goes on, and are dropped when the conversation's next turn ends.)"""
        if len(tiers) != -(-tokens // self.chunk_size):
            raise ValueError(
                f"{len(tiers)} tiers for {tokens} positions ({-(-tokens // self.chunk_size)} chunks)"
            )
        rank = {DROPPED: 0, DISK: 0, CPU: 1, GPU: 2, BOTH: 2}
        last, gpu, cpu = 0, 0, 0
        first = self.windows.kept_from(tokens)
        for i, tier in enumerate(tiers):
            if tier not in rank:
                raise ValueError(f"chunk {i}: unknown tier {tier!r}, not one of {RESIDENCIES}")
            if rank[tier] < last:
                raise ValueError(
                    f"chunk {i} on {tier} after a chunk on a faster tier: a table is laid "
                    "out [dropped or disk | cpu | gpu or both]"
                )
            last = rank[tier]
            if tier == DISK and not self.spills.spilling:
                raise ValueError(f"chunk {i} on disk: this engine has no disk tier")
            if tier == DISK and (i + 1) * self.chunk_size > tokens:
                raise ValueError(f"chunk {i} on disk is not full: only full chunks are files")
            pages = self.tiers.pages(i >= first)
            gpu += pages if tier in (GPU, BOTH) else 0
            cpu += pages if tier in (CPU, BOTH) else 0
        if cpu and not self.tiers.cpu.num_blocks:
            raise ValueError(f"chunks on the CPU tier: this engine has none ({self.mode})")
        return gpu, cpu

    def place(self, t: ChunkTable, tiers: Sequence[str], tokens: int) -> None:
        """Give an empty, idle table the chunks of `tokens` positions in the tiers given
        (`blocks`), through the tiers' own accounting: a seeded state, whose KV is
        whatever the blocks hold (`Engine.seed`). A chunk on "disk" is dropped here (the
        disk tier holds it). ValueError if the blocks are not free."""
        if t.chunks or t.pinned:
            raise ValueError(f"conversation {t.id!r} holds chunks already")
        gpu, cpu = self.blocks(tiers, tokens)
        if gpu > self.tiers.gpu.num_free or cpu > self.tiers.cpu.num_free:
            raise ValueError(
                f"{gpu} GPU and {cpu} CPU blocks asked, {self.tiers.gpu.num_free} and "
                f"{self.tiers.cpu.num_free} free"
            )
        first = self.windows.kept_from(tokens)  # as `slide` leaves it
        for tier in tiers:
            c = Chunk()
            t.chunks.append(c)
            window = len(t.chunks) - 1 >= first
            if tier in (GPU, BOTH):
                self.tiers.set_gpu(t, c, window)
            if tier in (CPU, BOTH):
                pages = self.tiers.pages(window)
                self.tiers.set_cpu(t, c, tuple(self.tiers.cpu.allocate() for _ in range(pages)))
        t.n_dropped = t.n_shared = sum(1 for x in tiers if x in (DROPPED, DISK))
        t.n_off_gpu = t.n_dropped + sum(1 for x in tiers if x == CPU)
        t.tokens = tokens
        t.slid = first
        t.gone = min(self.windows.gone_before(tokens), t.n_dropped)
        self.order.changed(t)
