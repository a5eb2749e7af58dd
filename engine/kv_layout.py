"""Where each layer's KV lives in the pool's pages: one group of pages for the layers that
attend to every key, one per slice of the sliding layers.

A page holds `chunk_size` positions of K and V for `slots` layers. A chunk of a conversation
takes one page in each group whose layers still read it: the full group always, the sliding
groups only while the chunk is inside their window (a query at position p of a sliding layer
reads no key before p - window + 1). Layer i keeps its KV in slot `slot_of[i]` of the pages
that its group's block table (`group_of[i]`) names.

Without a window, or with no layer sliding, there is one group whose page holds every layer:
today's block of `chunk_size` tokens of every layer. With every layer sliding (Mistral, Phi-3
mini 4k) there is one group too, and a chunk the window has left holds nothing at all
(`gone`): no layer reads it again. With a mix (Gemma 3, five of
six layers sliding; gpt-oss, every other one), a page holds as many layers as there are full
ones, and the sliding layers fill `groups - 1` pages of those slots each (the last one padded
where they do not divide evenly: Gemma 3 1B, 4 full and 22 sliding layers, pads 2 slots).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model.shapes import ModelArgs


@dataclass(frozen=True)
class KVLayout:
    n_layers: int
    slots: int  # layers a page holds
    slot_of: tuple[int, ...]  # per layer: its slot in a page
    group_of: tuple[int, ...]  # per layer: the group whose pages hold its KV (0: full layers)
    window: int | None = None  # the sliding layers' window in positions (None: none kept)

    @staticmethod
    def of(args: ModelArgs, savings: bool = True) -> KVLayout:
        """The layout of `args`. `savings` False (or a model without sliding layers, or whose
        reader does not know which layers slide) keeps every layer in one group, every chunk."""
        n = args.n_layers
        windows = [args.window(i) for i in range(n)]
        full = [i for i in range(n) if windows[i] is None]
        sliding = [i for i in range(n) if windows[i] is not None]
        if not (savings and sliding and args.spec.exact_window):
            return KVLayout(n, n, tuple(range(n)), (0,) * n)
        if len({windows[i] for i in sliding}) > 1:
            raise ValueError("sliding layers with different windows are not supported")
        if not full:  # every layer slides: one group, whose chunks go once the window left
            return KVLayout(n, n, tuple(range(n)), (0,) * n, windows[0])
        slot, group = [0] * n, [0] * n
        for j, i in enumerate(full):
            slot[i] = j
        for j, i in enumerate(sliding):
            group[i], slot[i] = 1 + j // len(full), j % len(full)
        return KVLayout(n, len(full), tuple(slot), tuple(group), windows[sliding[0]])

    @property
    def groups(self) -> int:
        return max(self.group_of, default=0) + 1

    @property
    def windowed(self) -> bool:
        """Sliding and full layers: the sliding groups' pages go once the window left."""
        return self.groups > 1

    @property
    def gone(self) -> bool:
        """Every layer slides: a chunk the window left holds nothing (`ChunkTable.gone`)."""
        return self.window is not None and self.groups == 1

    def pages(self, pool_chunks: int) -> int:
        """Pages in a tier of `pool_chunks` chunks of every layer's KV (same bytes)."""
        return pool_chunks * self.n_layers // self.slots

    def page_bytes(self, chunk_bytes: int) -> int:
        """Bytes of a page, from those of a chunk of every layer."""
        return chunk_bytes * self.slots // self.n_layers

    def first_read(self, position: int, chunk_size: int) -> int:
        """The first chunk a sliding layer may still read from queries at `position` or
        later: the earlier ones have left the window for good (0 without a window)."""
        if self.window is None:
            return 0
        return max(0, position - self.window + 1) // chunk_size
