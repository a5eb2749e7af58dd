"""The engine: turns in, tokens out; each conversation's KV kept across turns. A facade that
builds the parts over one backend and holds the lock: conversations (`engine/conversations.py`)
own their records and lives, the step loop (`engine/steps.py`) runs the scheduler's plans."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from engine.backends import Backend, pick
from engine.cache.manager import KVCacheManager
from engine.cache.pins import Retained
from engine.cache.policy import CostModel, Policy
from engine.cache.retention import Retainer
from engine.capture import capture
from engine.conversations import Conversations
from engine.disk.tier import DiskTier
from engine.guide import check
from engine.kv_events import Event, KVEvents
from engine.kv_layout import KVLayout
from engine.persistence import ActivityClock, LocalClock, MemoryHistory, TokenHistory
from engine.reads import Reads
from engine.request import Request, Status
from engine.scheduler import Scheduler
from engine.seed import Seed, plant
from engine.snapshot import Capture, EngineCounters, EngineSnapshot
from engine.steps import Steps
from engine.types import CacheMode, EngineConfig, Eviction, Turn, TurnResult

log = logging.getLogger(__name__)


class Engine:
    """Synchronous core. `run` serves a batch of turns; `submit` + `step` drive it finely."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        history: TokenHistory | None = None,
        clock: ActivityClock | None = None,
        now: Callable[[], float] | None = None,
        backend: Backend | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        config.validate()
        # What it runs on, chosen once (engine/backends/): nothing below asks which it is.
        self.backend = b = backend or pick(config, Engine, now)
        self.now = b.now  # every time the engine and its parts read (virtual if simulated)
        self.device, self.dtype, self.args = b.device, b.dtype, b.args
        self.model, self.tokenizer, self.stop_token_ids = b.model, b.tokenizer, b.stop_token_ids
        self.attention = b.attention
        self.max_context = self.args.max_context  # a sliding window caps it

        cs = config.chunk_size
        # Pages per layer group: a tier's chunks of every layer are more pages with sliding
        # groups, a chunk outside the window holding fewer (engine/kv_layout.py)
        layout = KVLayout.of(self.args, config.window_savings)
        gpu, cpu = (layout.pages(n) for n in b.tier_sizes())
        self.pool = b.pool(gpu, cpu, layout)
        cpu = self.pool.cpu_blocks  # may be less than asked: pinned memory is limited
        owns_history = history is None
        self.history = MemoryHistory() if history is None else history
        self.clock = LocalClock(self.now) if clock is None else clock
        self.counters = EngineCounters()  # the cache and prefetch add to it too
        costed = config.eviction != Eviction.LRU and config.cache_mode != CacheMode.STATELESS
        cost = b.policy_cost(self.max_context) if costed else CostModel.linear(cs, self.max_context)
        policy = Policy(config.eviction, cost, cs, self.clock, config.tool_value, config.tool_holds)
        self.cache = KVCacheManager(
            gpu, cpu, cs, policy, config.cache_mode, config.admit_reserve,
            config.swap_out_threshold, now=self.now, share=config.share_prefixes,
            counters=self.counters, layout=layout,
        )  # fmt: skip
        share, quantum = config.prefetch_limits(b.gpu)
        self.scheduler = Scheduler(
            self.cache, config.max_batch_tokens, config.max_running, config.unified,
            prefetch_share=share, prefetch_step_tokens=quantum, now=self.now,
            stop_token_ids=self.stop_token_ids, max_context=self.max_context,
        )  # fmt: skip
        self.runner = b.runner(self.pool)
        # Constrained decoding: the llguidance tokenizer is built on the first guided turn.
        self.guides = b.guides()
        if self.guides is not None:
            self.runner.guides = self.guides
        b.finish(self.runner, self.pool, self.max_context, gpu)
        self.disk: DiskTier | None = None
        if config.disk_cache_dir and config.cache_mode == CacheMode.PENSIEVE:
            self.disk = DiskTier(b.disk(cost, self.pool.bytes_per_chunk), self.pool, self.cache)
        self.reads = Reads(b, self.history, owns_history, self.cache, self.disk)
        self.retainer = Retainer(self.cache, self.pool.bytes_per_chunk, self.now)
        self.conversations = c = Conversations(
            config, self.cache, self.scheduler, self.history, owns_history, self.clock,
            self.counters, self.now, self.device, self.max_context, self.retainer, self.disk,
        )  # fmt: skip
        self.streams, self.claims = c.streams, c.claims  # read by fronts, benchmarks, tests
        # Where each conversation's chunks live, for a fleet's prefix routers (off: None)
        self.events = KVEvents(cs) if config.kv_events else None
        if self.events is not None:
            c.events, self.cache.tiers.touched = self.events, set()
        # The host runs a step ahead: it plans and launches step N before reading N-1's tokens
        ahead = config.async_steps
        ahead = self.device.type == "cuda" if ahead is None else ahead
        self.steps = Steps(
            b, self.scheduler, self.cache, c, self.pool, self.runner, self.reads, self.disk,
            self.counters, self.now, ahead and getattr(self.runner, "runs_ahead", False),
        )  # fmt: skip
        self.lock = threading.RLock()  # guards all state below; held for a whole step

    # ---- turns in ----------------------------------------------------------------------------

    def validate(self, turn: Turn) -> None:
        """Errors that need no engine state."""
        turn.validate(self.args.vocab_size)
        if turn.sampling.guide is not None:
            if self.guides is None:
                raise ValueError(
                    "a simulated device cannot follow a guide: it samples no real tokens"
                )
            check(turn.sampling.guide)

    @property
    def context_limit(self) -> int:
        """Most tokens one conversation can hold: the model's positions, and the whole GPU
        tier (a turn's context must fit there while it runs, with room for one more)."""
        return min(self.max_context, self.cache.gpu_capacity() * self.cache.chunk_size) - 1

    def accept(
        self, turn: Turn, queued: int = 0, retry_s: Callable[[int], float] | None = None
    ) -> None:
        """Check the turn (`validate`), claim its conversation (ConversationBusy if a turn
        of it is in flight), and apply the queue's limit: with `queued` turns submitted and
        not running, `max_waiting` or more refuse it (EngineOverloaded, its claim released;
        `retry_s(queued)`: when to try again); a pin past its owner's cap is refused here
        (PinRefused). Needs no step: the async front calls it on its event loop, a
        simulated replay before each `submit`."""
        self.validate(turn)
        self.conversations.claim(turn, queued, retry_s)

    def queued(self) -> int:
        """Real turns submitted and not running (waiting for admission, or suspended): what
        the queue's limit counts where turns are submitted straight to this engine."""
        return self.scheduler.counts()[1]

    def submit(
        self, turn: Turn, on_token: Callable[[int], None] | None = None, accepted: bool = False
    ) -> Request:
        """Queue a turn; `accepted`: the caller ran `accept` for it already."""
        if not accepted:
            self.accept(turn)
        try:
            # Built outside the lock: a large grammar takes a while (llguidance drops the GIL).
            sp = turn.sampling
            guide = None if sp.guide is None else self.guides.matcher(sp.guide)
            with self.lock:
                return self.conversations.open(turn, on_token, guide)
        except BaseException:
            self.conversations.withdraw(turn.conversation_id)
            raise

    def cancel(self, req: Request) -> None:
        req.cancelled = True

    # ---- a conversation's life ---------------------------------------------------------------

    def prefetch(self, conversation_id: str) -> None:
        """The user of an idle conversation is typing: the scheduler's prefetch starts
        bringing its context back to the GPU tier at low priority (`engine/prefetch.py`; a
        no-op for unknown, busy or prefetching conversations, the baseline modes, a context
        all on the GPU)."""
        with self.lock:
            self.conversations.hint(conversation_id)

    def fork(
        self, parent_id: str, child_id: str, token_ids: list[int], parent_len: int | None = None
    ) -> int:
        """Start conversation `child_id` as a copy of the first `len(token_ids)` tokens (given)
        of `parent_id`'s stream, linking the parent's full chunks of them (`KVCacheManager
        .fork`); its first turn computes only the rest. `parent_len`: the parent's length in
        the caller's history (none linked if the engine's differs). Returns the positions
        linked; 0 (a busy, unknown or partly dropped parent, sharing off) leaves the child
        unknown: its first turn recomputes its context from history, as after a restart."""
        with self.lock:
            return self.conversations.fork(parent_id, child_id, token_ids, parent_len)

    def rewrite(self, conversation_id: str, keep: int, token_ids: list[int], length: int) -> bool:
        """Replace the stream's tokens after its first `keep` with `token_ids`, whose KV the
        next turn computes: a thinking reply re-encoded as the chat template renders it in
        history. `length`: the stream's length in the caller's history before the change.
        False (nothing changed) for an unknown or busy conversation, or another length."""
        with self.lock:
            return self.conversations.rewrite(conversation_id, keep, token_ids, length)

    def free(self, conversation_id: str, erase: bool = False) -> None:
        """Forget a conversation's cache (its turns must have ended). `erase`: remove its
        chunks from the disk tier too, and its pin (a deleted conversation's; another
        conversation that starts the same way recomputes what it shared)."""
        with self.lock:
            self.conversations.free(conversation_id, erase)

    def seed(self, seeds: Iterable[Seed]) -> None:
        """Place conversations in the tiers as a given state says, without running their
        turns (`engine/seed.py`): each one's next turn goes on from there. For measurement:
        the KV of a chunk placed on a tier is not computed. All or none; ValueError while
        turns are in flight, for a conversation held already or a residency this engine
        cannot hold."""
        with self.lock:
            if self.has_work():
                raise ValueError("turns are in flight: seed an idle engine")
            plant(self.conversations, self.pool, seeds)

    def tools_called(self, conversation_id: str, tools: list[str]) -> None:
        """The conversation's last turn ended calling `tools`: it waits for their results,
        expected back in the time those tools took before, its KV held in memory meanwhile
        (`engine/cache/toolwait.py`)."""
        with self.lock:
            self.conversations.tools_called(conversation_id, tools)

    def unpin(self, conversation_id: str) -> None:
        """Let the conversation's pin and priority go at once (its client deleted it)."""
        self.retainer.release(conversation_id)

    def retained(self, conversation_id: str) -> Retained | None:
        """What the conversation's retention holds now (its pin, until when in wall time; its
        priority; a finished session), for the caller to keep across a restart; None:
        nothing. Thread-safe."""
        return self.retainer.retained(conversation_id)

    def restore_retention(self, kept: list[Retained]) -> int:
        """Put back retention `retained` read out before a restart: pins still in force (until
        the same wall time, counted against their owners' caps), priorities, finished
        sessions. Returns the pins put back. Thread-safe."""
        return self.retainer.restore(kept)

    # ---- the step loop -----------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.steps.has_work()

    @property
    def in_flight(self) -> bool:
        """A lagged step was launched and its tokens are not read yet (the next `step` or
        `flush` reads them)."""
        return self.steps.flight is not None

    def step(self) -> list[Request]:
        """Plan and run one batch; returns the turns that ended in it (`Steps.step`)."""
        self.backend.use_device()  # steps may run on another thread than the one that built it
        with self.lock:
            return self.steps.step()

    def flush(self) -> list[Request]:
        """Read the tokens of the lagged step in flight, if any, launching none; returns the
        turns they ended."""
        self.backend.use_device()
        with self.lock:
            return self.steps.flush()

    def fail_all(self, error: BaseException) -> list[Request]:
        """End every turn in flight with `error` (a step failed: the state may be broken);
        returns them."""
        with self.lock:
            return self.steps.fail_all(error)

    def next_read_s(self) -> float | None:
        """Where time is virtual: when the first history read still running ends (None:
        none is, or time is not virtual)."""
        return self.backend.next_read_s(self.reads.pending(self.scheduler.queued()))

    def wait_for_io(self, timeout: float = 0.05) -> None:
        """Nothing could be scheduled: wait until a history read finishes (simulated: move
        the virtual clock to its end)."""
        self.backend.wait_for_reads(self.reads.pending(self.scheduler.queued()), timeout)

    def run(self, turns: list[Turn]) -> list[TurnResult]:
        reqs = [self.submit(t) for t in turns]
        while any(r.status != Status.FINISHED for r in reqs):
            ended = self.step()
            running = any(r.status == Status.RUNNING for r in reqs)
            if not ended and not running and not self.in_flight:
                self.wait_for_io()
        self.flush()  # the last lagged step's tokens: of turns that ended already
        return [r.result() for r in reqs]

    # ---- inspection --------------------------------------------------------------------------

    def snapshot(self) -> EngineSnapshot:
        return self.capture().build()

    def capture(self) -> Capture:
        """The facts of a snapshot, read under the lock in O(1) a conversation (`Held`);
        `build()` spells them out without it."""
        with self.lock:
            return capture(
                self.conversations, self.scheduler.counts(), str(self.device), self.context_limit,
                self.pool.layout.page_bytes(self.pool.bytes_per_chunk),
            )  # fmt: skip

    def kv_events(self, full: bool = False) -> list[Event]:
        """The KV events since the last call (engine/kv_events.py); none when they are off.
        `full`: everything cleared and announced again (a subscriber joined)."""
        if self.events is None:
            return []
        with self.lock:
            return self.events.poll(self.cache, self.streams, self.disk, full)

    def announce_disk(self, histories: list[tuple[str, list[int]]]) -> int:
        """At a start: announce in the KV events what the disk tier holds of conversations
        not back yet (`histories`: each one's id and tokens, from the history). Returns how
        many had chunks there."""
        if self.events is None or self.disk is None:
            return 0
        with self.lock:
            on_disk, n = self.disk.keys(), 0
            for cid, tokens in histories:
                if cid not in self.cache.tables:
                    self.events.restore(cid, tokens, on_disk)
                    n += cid in self.events.restored
            return n

    def write_back(self, limit: int | None = None) -> int:
        """Write the full chunks held in memory that the disk tier lacks, of idle
        conversations: all of them and wait (a graceful stop: the next process reads them
        instead of recomputing), or at most `limit` without waiting (while the engine is
        idle, so that a crash loses little). Returns the chunks queued."""
        if self.disk is None or not self.disk.writable:
            return 0
        with self.lock:
            n = self.disk.write_back(self.streams, limit)
        if limit is None:
            self.disk.flush()
        return n

    def close(self) -> None:
        if self.disk is not None and self.backend.keeps_disk:  # a simulation's holds nothing
            try:
                self.write_back()
            except Exception:  # a stop must not fail on it: the next start recomputes
                log.exception("could not write the cache back to the disk tier")
            self.disk.close()
        if self.guides is not None:
            self.guides.close()
        self.backend.close()
