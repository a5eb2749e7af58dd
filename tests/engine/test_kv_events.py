"""KV events (engine/kv_events.py) read by a prefix router: a small model of the one the
field runs (Dynamo's indexer: a tree per medium, a block found under its parent in its own
tier or a faster one, a removal taking its children with it), fed by a real engine through
swaps, drops, shared prefixes and frees. The app's test runs Dynamo's own indexer."""

from __future__ import annotations

from array import array

from engine import Engine, EngineConfig, SamplingParams, Turn
from engine.cache.manager import chain_hashes
from engine.kv_events import MEDIA, AllCleared, BlockRemoved, BlockStored, KVEvents, block_hash


class Router:
    """One worker's blocks per medium, as Dynamo's indexer keeps them."""

    def __init__(self) -> None:
        self.trees: dict[str, dict[int, int | None]] = {m: {} for m in MEDIA}  # hash -> parent
        self.tokens: dict[int, list[int]] = {}
        self.refused = 0  # stores whose parent it did not know (Dynamo skips them)

    def apply(self, events) -> None:
        for e in events:
            if isinstance(e, AllCleared):
                self.trees = {m: {} for m in MEDIA}
            elif isinstance(e, BlockStored):
                tiers = MEDIA[: MEDIA.index(e.medium) + 1]
                if e.parent is not None and not any(e.parent in self.trees[m] for m in tiers):
                    self.refused += 1
                    continue
                parent = e.parent
                for i, h in enumerate(e.hashes):
                    self.trees[e.medium][h] = parent
                    self.tokens[h] = e.tokens[i * 32 : (i + 1) * 32]
                    parent = h
            else:
                for h in e.hashes:
                    assert h in self.trees[e.medium], ("removed an unknown block", h)
                    self._remove(e.medium, h)

    def _remove(self, medium: str, h: int) -> None:
        tree = self.trees[medium]
        tree.pop(h, None)
        for child in [c for c, p in tree.items() if p == h]:
            self._remove(medium, child)

    def match(self, tokens: list[int]) -> dict[str, int]:
        """Tokens of the longest prefix served from each medium or a faster one."""
        out, n, medium = {}, 0, 0
        for key in chain_hashes(tokens, 32):
            h = block_hash(key)
            while medium < len(MEDIA) and h not in self.trees[MEDIA[medium]]:
                out[MEDIA[medium]] = n
                medium += 1
            if medium == len(MEDIA):
                break
            assert self.tokens[h] == tokens[n : n + 32]
            n += 32
        for m in MEDIA[medium:]:
            out[m] = n
        return out


def engine(**kw) -> Engine:
    config = dict(device="cpu", gpu_cache_chunks=12, cpu_cache_chunks=12, max_batch_tokens=512)
    config.update(kw)
    return Engine(EngineConfig(model="dummy:tiny", kv_events=True, **config))


def chat(e: Engine, cid: str, context: list[int], prompt: list[int]) -> list[int]:
    [r] = e.run([Turn(cid, prompt, SamplingParams(max_tokens=8, ignore_eos=True))])
    return context + prompt + r.token_ids


def test_a_router_matches_each_conversation_where_it_lives():
    e, router = engine(), Router()
    router.apply(e.kv_events())
    a = chat(e, "a", [], list(range(100, 200)))
    router.apply(e.kv_events())
    full = len(a) // 32 * 32
    assert router.match(a) == {"GPU": full, "CPU": full, "STORAGE": full}
    assert router.match([7] + a)["STORAGE"] == 0  # another prefix matches nothing

    # other chats push a's leading chunks to the CPU, then drop them: the prefix's medium
    # is its slowest chunk's, and a dropped leading end is served from "storage"
    contexts, seen = {}, set()
    for i in range(6):
        contexts[i] = chat(e, f"c{i}", [], list(range(1000 * (i + 1), 1000 * (i + 1) + 90)))
        router.apply(e.kv_events())
        tiers = [c.tier for c in e.cache.find("a").chunks[: full // 32]]
        match = router.match(a)
        if tiers[0] == "dropped" and tiers[-1] != "dropped":
            assert match == {"GPU": 0, "CPU": 0, "STORAGE": full}, match
        elif tiers[0] == "cpu":
            assert match == {"GPU": 0, "CPU": full, "STORAGE": full}, match
        seen.add(tiers[0])
    assert seen >= {"cpu", "dropped"}, "the test wants a's leading chunks swapped and dropped"
    assert router.refused == 0
    # a's return brings it back on the GPU
    a = chat(e, "a", a, list(range(300, 340)))
    router.apply(e.kv_events())
    full = len(a) // 32 * 32
    assert router.match(a)["GPU"] == full
    # a freed conversation is gone from the router
    e.free("a")
    router.apply(e.kv_events())
    assert router.match(a)["STORAGE"] == 0
    for i, ctx in contexts.items():  # every match is of a real chunk, where it lives
        t = e.cache.find(f"c{i}")
        held = any(c.tier != "dropped" for c in t.chunks[: len(ctx) // 32])  # a full one
        assert (router.match(ctx)["STORAGE"] > 0) == held
    e.cache.check()


def test_a_shared_prefix_is_one_block_until_its_last_holder_lets_go():
    e, router = engine(share_prefixes=True), Router()
    system = list(range(500, 564))  # two full chunks
    a = chat(e, "a", [], system + [1, 2, 3])
    b = chat(e, "b", [], system + [4, 5, 6])
    events = e.kv_events()
    router.apply(events)
    stored = [h for ev in events if isinstance(ev, BlockStored) for h in ev.hashes]
    assert len(stored) == len(set(stored))  # the system prompt's chunks stored once
    e.free("a")
    router.apply(e.kv_events())
    assert router.match(system)["GPU"] == 64  # b still holds them
    assert router.match(b)["GPU"] == len(b) // 32 * 32 and router.match(a)["GPU"] == 64
    e.free("b")
    router.apply(e.kv_events())
    assert router.match(system)["STORAGE"] == 0


def test_events_are_a_diff():
    """Unit: the bookkeeping alone, on a hand-made sequence of wants."""
    ev = KVEvents(32)
    assert ev.pending == [AllCleared()]
    ev.pending = []
    ev.tokens["x"] = array("i", [1] * 32 + [2] * 32 + [3] * 32)
    ev._show("x", [(1, 0), (2, 0), (3, 0)])
    assert ev.pending == [BlockStored([1, 2, 3], None, [1] * 32 + [2] * 32 + [3] * 32, "GPU")]
    ev.pending = []
    ev._show("x", [(1, 1), (2, 1), (3, 1)])  # the first chunk went to the CPU
    assert ev.pending == [
        BlockRemoved([3, 2, 1], "GPU"),
        BlockStored([1, 2, 3], None, [1] * 32 + [2] * 32 + [3] * 32, "CPU"),
    ]
    ev.pending = []
    ev._show("x", [(1, 1), (2, 1)])  # cut back
    assert ev.pending == [BlockRemoved([3], "CPU")]
    assert ev.announced() == {"GPU": 0, "CPU": 2, "STORAGE": 0}


def test_a_joining_subscriber_gets_everything_once():
    ev = KVEvents(32)
    ev.tokens = {"x": array("i", [1] * 32 + [2] * 32), "y": array("i", [1] * 32 + [3] * 32)}
    ev._show("x", [(1, 0), (2, 1)])
    ev._show("y", [(1, 0), (3, 0)])
    assert ev._everything() == [
        BlockStored([1], None, [1] * 32, "GPU"),
        BlockStored([2], 1, [2] * 32, "CPU"),
        BlockStored([3], 1, [3] * 32, "GPU"),  # block 1 once, under it both children
    ]


def test_a_prompts_chunks_are_announced_while_its_turn_runs():
    """Announced as their KV is computed, before the turn ends: a router that sees the next
    request at once already finds them."""
    e = engine()
    e.kv_events()
    req = e.submit(Turn("p", list(range(100, 200)), SamplingParams(max_tokens=64, ignore_eos=True)))
    stored = []
    while not stored:
        e.step()
        stored = [ev for ev in e.kv_events() if isinstance(ev, BlockStored)]
    assert len(req.output) < 64 and stored[0].tokens == list(range(100, 196))  # 3 full chunks
    while e.has_work():
        e.step()


def test_a_conversation_restored_from_disk_stays_announced_until_it_returns():
    e, router = engine(), Router()
    tokens = list(range(400, 500))
    keys = chain_hashes(tokens, 32)
    e.events.restore("r", tokens, {keys[1]})  # its second chunk on disk: two announced
    router.apply(e.kv_events())
    assert router.match(tokens) == {"GPU": 0, "CPU": 0, "STORAGE": 64}
    chat(e, "other", [], list(range(9000, 9050)))  # other work polls: r stays
    router.apply(e.kv_events())
    assert router.match(tokens)["STORAGE"] == 64
    e.events.restore("none", list(range(7000, 7100)), set())  # nothing on disk: nothing
    assert e.kv_events() == [] and "none" not in e.events.tokens
