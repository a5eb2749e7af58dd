"""KV events: every change of where a conversation's full chunks live, as the prefix routers
of a fleet read it (NVIDIA Dynamo's KV router, vLLM's router, llm-d's scorer; vLLM's events).

A router keeps one prefix tree per medium (GPU, CPU, STORAGE) and matches a request down
them: a block is found under its parent in its own tier or a faster one. So a chunk is
announced in the slowest tier of any chunk up to it (the tier its whole prefix can be served
from), and a change at chunk i re-announces i and the chunks after it. A conversation whose
leading chunks were dropped while later ones are held (Pensieve drops leading chunks of idle
chats first) is announced in STORAGE up to its last held chunk: this server serves it by
recomputing only the leading end from the history, which beats a server that holds nothing;
once every chunk is gone, nothing is announced. The same chunk of several conversations (a
shared prefix, the same system prompt) is one block to a router: announced once per medium,
removed when its last holder lets go of it there.

Pure bookkeeping: `collect` diffs what is announced against the cache's tables (only the
ones that changed: `Tiers.touched`) and returns the events; a front publishes them
(app/kv_events.py).
"""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.cache.chunks import CPU, GPU
from engine.cache.sharing import chain_hashes

if TYPE_CHECKING:
    from engine.cache.manager import KVCacheManager
    from engine.stream import StreamState

MEDIA = ("GPU", "CPU", "STORAGE")  # fastest first: a prefix is in the slowest of its chunks'
_RANK = {GPU: 0, CPU: 1}  # a chunk held nowhere in memory is 2 (disk, or recomputed)


@dataclass(frozen=True)
class BlockStored:
    hashes: list[int]
    parent: int | None  # the block before the first (None: it starts the conversation)
    tokens: list[int]  # every block's tokens, in order
    medium: str


@dataclass(frozen=True)
class BlockRemoved:
    hashes: list[int]
    medium: str


@dataclass(frozen=True)
class AllCleared:
    pass


Event = BlockStored | BlockRemoved | AllCleared
Shown = list[tuple[int, int]]  # per announced chunk: (block hash, medium index)


def block_hash(key: bytes) -> int:
    """A chunk's block hash for routers: the first 8 bytes of its chain hash (the disk tier's
    key), so equal tokens from position 0 give the same hash on every replica."""
    return int.from_bytes(key[:8], "big")


class KVEvents:
    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.shown: dict[str, Shown] = {}  # what each conversation has announced
        self.held: Counter[tuple[int, int]] = Counter()  # (hash, medium): announcing them
        # Each conversation's tokens as far as known (its prompt from the moment it is
        # submitted: a chunk is announced as soon as its KV is computed), and the chain hash
        # of each full chunk of them
        self.tokens: dict[str, array] = {}
        self.keys: dict[str, list[bytes]] = {}
        self.pending: list[Event] = [AllCleared()]  # a start clears what a router knew
        self.dirty: set[str] = set()  # conversations whose tokens changed since
        # Conversations announced from the disk tier at a start, before they have a table
        self.restored: set[str] = set()

    def restore(self, cid: str, tokens: list[int], on_disk: set[bytes]) -> None:
        """A start found chunks of the conversation (its tokens read from the history) on
        the disk tier: its prefix up to the last of them is announced in STORAGE (the chunks
        before it that are not there are recomputed, as a dropped leading end is)."""
        self.extend(cid, 0, tokens)
        keys = self.keys[cid]
        last = max((i for i, k in enumerate(keys) if k in on_disk), default=-1)
        if last < 0:
            self.tokens.pop(cid, None)
            self.keys.pop(cid, None)
            return
        self.restored.add(cid)
        self._show(cid, [(block_hash(k), 2) for k in keys[: last + 1]])

    def poll(
        self, cache: KVCacheManager, streams: dict[str, StreamState], disk, full: bool = False
    ) -> list[Event]:
        """The events since the last poll (under the engine's lock): of the conversations
        whose chunks changed (`Tiers.touched`), were learned, or were freed. `full`: a
        subscriber joined (one that knew this server before a restart, say): everything is
        cleared and announced again instead."""
        freed = self.shown.keys() - cache.tables.keys() - self.restored
        changed = cache.tiers.touched | self.dirty | freed
        cache.tiers.touched, self.dirty = set(), set()
        dropped = any(cache.tables[c].n_dropped for c in changed if c in cache.tables)
        on_disk = disk.keys() if disk is not None and dropped else frozenset()
        events = self.collect(cache, streams, changed, on_disk)
        return [AllCleared(), *self._everything()] if full else events

    def _everything(self) -> list[Event]:
        """Every announced block stored again: each once, a run a medium per conversation."""
        out: list[Event] = []
        seen: set[tuple[int, int]] = set()
        cs = self.chunk_size
        for cid, shown in self.shown.items():
            tokens, i = self.tokens[cid], 0
            while i < len(shown):
                if shown[i] in seen:
                    i += 1
                    continue
                j = i
                while j < len(shown) and shown[j][1] == shown[i][1] and shown[j] not in seen:
                    seen.add(shown[j])
                    j += 1
                parent = shown[i - 1][0] if i else None
                run = range(i, j)
                hashes, toks = [shown[n][0] for n in run], tokens[i * cs : j * cs].tolist()
                out.append(BlockStored(hashes, parent, toks, MEDIA[shown[i][1]]))
                i = j
        return out

    def extend(
        self, cid: str, base: int, tokens: list[int], prefix: list[int] | None = None
    ) -> None:
        """The conversation's tokens from position `base` on are `tokens` (those before it:
        as known, or `prefix`, the history read for a turn; unknown after a restart until
        a turn reads it)."""
        known = self.tokens.get(cid, array("i"))
        if len(known) < base:
            if prefix is None or len(prefix) < base:
                return
            known = array("i", prefix[:base])
            self.keys[cid] = []
        del known[base:]
        known.extend(tokens)
        self.tokens[cid] = known
        cs, keys = self.chunk_size, self.keys.setdefault(cid, [])
        del keys[base // cs :]
        done = len(keys) * cs
        full = len(known) // cs * cs
        keys += chain_hashes(known[done:full].tolist(), cs, keys[-1] if keys else b"")
        self.dirty.add(cid)

    def collect(
        self,
        cache: KVCacheManager,
        streams: dict[str, StreamState],
        changed: set[str],
        on_disk: set[bytes] | frozenset = frozenset(),
    ) -> list[Event]:
        """The events since the last call, for the conversations in `changed` (tables
        touched, freed, or whose tokens changed)."""
        for cid in changed:
            t, state = cache.tables.get(cid), streams.get(cid)
            if t is None and cid in self.restored:
                continue  # announced from the disk tier until it comes back
            self.restored.discard(cid)
            want: Shown = []
            if t is not None:
                # positions whose KV is computed: a running turn's grow step by step
                computed = max(t.tokens, state.kv_len if state is not None else 0)
                want = self._wanted(t, computed, self.keys.get(cid, []), on_disk)
            else:
                self.tokens.pop(cid, None)
                self.keys.pop(cid, None)
            self._show(cid, want)
        out, self.pending = self.pending, []
        return out

    def _wanted(self, t, computed: int, keys: list[bytes], on_disk) -> Shown:
        """Per full chunk whose KV is computed, up to the last one held anywhere: its block
        hash and the slowest medium of the chunks up to it."""
        full = min(computed // self.chunk_size, len(t.chunks), len(keys))
        ranks = [_RANK.get(c.tier, 2) for c in t.chunks[:full]]
        held = [i for i, c in enumerate(t.chunks[:full]) if c.tier in _RANK]
        held += [i for i in range(min(t.n_dropped, full)) if keys[i] in on_disk]
        last = max(held, default=-1)
        out, rank = [], 0
        for i in range(last + 1):
            rank = max(rank, ranks[i])
            out.append((block_hash(keys[i]), rank))
        return out

    def _show(self, cid: str, want: Shown) -> None:
        """Announce `want` for the conversation: from the first chunk that differs, remove
        the old ones (the last first, so that no router drops a child with its parent) and
        store the new ones (a run a medium)."""
        old = self.shown.get(cid, [])
        k = 0
        while k < min(len(old), len(want)) and old[k] == want[k]:
            k += 1
        gone: list[tuple[int, int]] = []
        for key in reversed(old[k:]):
            self.held[key] -= 1
            if not self.held[key]:
                del self.held[key]
                gone.append(key)
        for m in range(len(MEDIA)):  # one event a medium, in the order they were let go
            hashes = [h for h, medium in gone if medium == m]
            if hashes:
                self.pending.append(BlockRemoved(hashes, MEDIA[m]))
        tokens, cs = self.tokens.get(cid, array("i")), self.chunk_size
        i = k
        while i < len(want):
            j, m = i, want[i][1]
            while j < len(want) and want[j][1] == m:
                j += 1
            new = [n for n in range(i, j) if self.held[want[n]] == 0]
            for n in range(i, j):
                self.held[want[n]] += 1
            if new:  # already known blocks are not stored twice (a shared prefix)
                run = list(range(new[0], j))  # from the first new one on, with its parent
                parent = want[run[0] - 1][0] if run[0] else None
                self.pending.append(
                    BlockStored(
                        [want[n][0] for n in run],
                        parent,
                        tokens[run[0] * cs : j * cs].tolist(),
                        MEDIA[m],
                    )
                )
            i = j
        if want:
            self.shown[cid] = want
        else:
            self.shown.pop(cid, None)

    def announced(self) -> dict[str, int]:
        """Blocks announced per medium (for tests and metrics)."""
        out = dict.fromkeys(MEDIA, 0)
        for _, m in self.held:
            out[MEDIA[m]] += 1
        return out
