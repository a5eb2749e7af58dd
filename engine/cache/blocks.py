"""A pool of fixed-size KV blocks: a free list of block ids, nothing else."""

from __future__ import annotations


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._is_free = [True] * num_blocks
        self.allocations = 0  # blocks handed out since the start

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self) -> int:
        block = self._free.pop()
        self._is_free[block] = False
        self.allocations += 1
        return block

    def release(self, block: int) -> None:
        if self._is_free[block]:
            raise RuntimeError(f"block {block} released twice")
        self._is_free[block] = True
        self._free.append(block)

    def is_free(self, block: int) -> bool:
        return self._is_free[block]
