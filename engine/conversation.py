"""A conversation's state in the engine: its token stream length and its chunk table."""

from __future__ import annotations

from dataclasses import dataclass, field

GPU, CPU, DROPPED = "gpu", "cpu", "dropped"


@dataclass
class Chunk:
    """`chunk_size` consecutive token positions. A chunk on the GPU may keep a CPU copy
    (written ahead of time, or left by a swap-in) so that its GPU block can be reclaimed
    for free; a chunk with neither is dropped and is recomputed from raw history."""

    gpu: int | None = None
    cpu: int | None = None

    @property
    def tier(self) -> str:
        return GPU if self.gpu is not None else CPU if self.cpu is not None else DROPPED


@dataclass
class Conversation:
    id: str
    length: int = 0  # tokens in the conversation's stream (prompts and outputs so far)
    kv_len: int = 0  # leading positions whose KV was computed (held by the chunks, or dropped)
    tail: list[int] = field(
        default_factory=list
    )  # tokens [kv_len, length): known, KV not computed yet
    chunks: list[Chunk] = field(default_factory=list)
    # Layout [dropped | CPU | GPU]: chunks [0, n_dropped) hold nothing, chunks
    # [n_dropped, n_off_gpu) only a CPU copy, the rest a GPU block.
    n_dropped: int = 0
    n_off_gpu: int = 0
    pinned: bool = False  # a turn of it is running: none of its chunks may be evicted
    busy: bool = False  # a turn of it is queued or running

    def tiers(self) -> list[str]:
        return [c.tier for c in self.chunks]

    def gpu_blocks(self, n_chunks: int) -> list[int]:
        blocks = [c.gpu for c in self.chunks[:n_chunks]]
        if any(b is None for b in blocks):
            raise RuntimeError(f"conversation {self.id!r} has chunks off the GPU while running")
        return blocks  # type: ignore[return-value]
