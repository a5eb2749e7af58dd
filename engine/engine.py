"""The engine: turns in, tokens out; each conversation's KV kept across turns."""

from __future__ import annotations

import itertools
import logging
import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch

from engine import retention
from engine.backends import Backend, pick
from engine.cache.manager import KVCacheManager, chain_hashes
from engine.cache.pins import Retained
from engine.cache.policy import CostModel, Policy
from engine.disk.tier import DiskTier
from engine.drain import DEFAULT_S as DEFAULT_RETRY_S
from engine.errors import ConversationBusy, EngineOverloaded
from engine.guide import check
from engine.persistence import ActivityClock, LocalClock, MemoryHistory, TokenHistory
from engine.reads import Reads
from engine.request import Request, Status
from engine.sampler import Sampled, make_generator
from engine.scheduler import Scheduler, StepPlan
from engine.seed import Seed, plant
from engine.snapshot import (
    Capture,
    EngineCounters,
    EngineSnapshot,
    Held,
    PoolUsage,
    SharingUsage,
)
from engine.stream import Claims, StreamState, extend_hashes, resync
from engine.types import (
    CacheMode,
    EngineConfig,
    Eviction,
    FinishReason,
    Turn,
    TurnResult,
    TurnStats,
)

log = logging.getLogger(__name__)


@dataclass
class Flight:
    """A launched step whose tokens the host has not read: the lagged path reads them during
    the next step's forward."""

    rows: list[Request]  # the turn of each sampled token, in order
    before: dict[Request, int]  # each turn's kv_len before the step's pieces moved it
    sampled: Sampled | list[int] | None  # the tokens: on their way (lagged), or read already

    def on_device(self) -> torch.Tensor | None:
        """The tokens on the device: what the next step's placeholders are filled from."""
        return self.sampled.tokens if isinstance(self.sampled, Sampled) else None

    def tokens(self) -> list[int]:
        s = self.sampled
        if s is None:
            return []
        return s if isinstance(s, list) else s.tolist()


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
        gpu, cpu = b.tier_sizes()
        self.pool = b.pool(gpu, cpu)
        cpu = self.pool.cpu_blocks  # may be less than asked: pinned memory is limited
        self.owns_history = history is None
        self.history = MemoryHistory() if history is None else history
        self.clock = LocalClock(self.now) if clock is None else clock
        self.counters = EngineCounters()  # the cache and prefetch add to it too
        costed = config.eviction != Eviction.LRU and config.cache_mode != CacheMode.STATELESS
        cost = b.policy_cost(self.max_context) if costed else CostModel.linear(cs, self.max_context)
        self.cache = KVCacheManager(
            gpu,
            cpu,
            cs,
            Policy(config.eviction, cost, cs, self.clock, config.tool_value),
            config.cache_mode,
            config.admit_reserve,
            config.swap_out_threshold,
            now=self.now,
            share=config.share_prefixes,
            counters=self.counters,
        )
        share, quantum = config.prefetch_limits(b.gpu)
        self.scheduler = Scheduler(
            self.cache,
            config.max_batch_tokens,
            config.max_running,
            config.unified,
            prefetch_share=share,
            prefetch_step_tokens=quantum,
            now=self.now,
        )
        self.runner = b.runner(self.pool)
        # Constrained decoding: the llguidance tokenizer is built on the first guided turn.
        self.guides = b.guides()
        if self.guides is not None:
            self.runner.guides = self.guides
        b.finish(self.runner, self.pool, self.max_context, gpu)
        self.streams: dict[str, StreamState] = {}  # written here only
        self.claims = Claims()  # one turn per conversation at a time, for every front
        self._seq = itertools.count()
        self.disk: DiskTier | None = None
        if config.disk_cache_dir and config.cache_mode == CacheMode.PENSIEVE:
            self.disk = DiskTier(b.disk(cost, self.pool.bytes_per_chunk), self.pool, self.cache)
        self.reads = Reads(b, self.history, self.owns_history, self.cache, self.disk)
        self.lock = threading.RLock()  # guards all state below; held for a whole step
        # The host runs a step ahead: it plans and launches step N before reading N-1's tokens
        ahead = config.async_steps
        ahead = self.device.type == "cuda" if ahead is None else ahead
        self.ahead = ahead and getattr(self.runner, "runs_ahead", False)
        self._flight: Flight | None = None  # the lagged step launched and not read yet

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
        `retry_s(queued)`: when to try again). Needs no step: the async front calls it on
        its event loop, a simulated replay before each `submit`."""
        self.validate(turn)
        self.claims.claim(turn.conversation_id)
        limit = self.config.max_waiting
        if queued >= limit:
            self.claims.release(turn.conversation_id)
            wait = DEFAULT_RETRY_S if retry_s is None else retry_s(queued)
            raise EngineOverloaded(f"the engine has {limit} turns queued already", wait)
        try:
            retention.reserve(self, turn)  # a pin past its owner's cap is refused here
        except BaseException:
            self.claims.release(turn.conversation_id)
            self.cache.policy.unexpect(turn.conversation_id)
            self.cache.policy.pins.unhold(turn.conversation_id)
            raise

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
            return self._queue(turn, on_token)
        except BaseException:
            self.claims.release(turn.conversation_id)
            self.cache.policy.unexpect(turn.conversation_id)
            self.cache.policy.pins.unhold(turn.conversation_id)
            raise

    def _queue(self, turn: Turn, on_token: Callable[[int], None] | None) -> Request:
        # Built outside the lock: a large grammar takes a while (llguidance drops the GIL).
        guide = None if turn.sampling.guide is None else self.guides.matcher(turn.sampling.guide)
        with self.lock:
            state = self.streams.get(turn.conversation_id)
            state = state or StreamState(turn.conversation_id)
            length = state.length if turn.context_len is None else turn.context_len
            total = length + len(turn.prompt_token_ids)
            if total >= self.max_context:
                raise ValueError(
                    f"context of {total} tokens reaches the model's limit of {self.max_context}"
                )
            if self.cache.n_chunks(total + 1) > self.cache.gpu_capacity():
                raise ValueError(
                    f"context of {total} tokens does not fit the KV cache "
                    f"({self.cache.gpu_capacity()} chunks of {self.cache.chunk_size})"
                )
            self.streams[state.id] = state
            table = self.cache.table(state.id)
            # Its prefetch ends; a running one goes on if the context stays, to be taken over.
            prefetch = self.scheduler.supersede(state.id, keep=length == state.length)
            if length != state.length:
                resync(state, length, self.cache)
            now = self.now()
            policy = self.cache.policy
            # `returns` learns how long people take; a tool's result is learned apart
            if state.idle_since is not None and not policy.tools.is_waiting(state.id):
                self.cache.returned(now - state.idle_since)
            if state.job_since is None or not policy.tools.is_waiting(state.id):
                state.job_since = now  # a new job; a tool's result goes on with its own
            policy.tools.arrived(state.id, now)  # a tool's result, maybe: learned
            self.clock.touch(state.id, now)
            # Queued, it is about to run: its chunks are the last idle ones to go (by its
            # idle time alone, `returns` and the tool value would value it as idle)
            policy.expect(state.id, math.inf)
            hold = policy.tools.hold_s() if self.config.tool_holds else None
            if hold is not None:  # a tool wait's hold: renewed while the turn waits to run
                policy.pins.hold_queued(state.id, now, hold)
            prompt = list(turn.prompt_token_ids)
            chain, shared = [], 0
            if state.length == 0:
                chain, shared = self.cache.link_prompt(table, prompt)
                state.kv_len = shared
            req = Request(
                turn=turn,
                state=state,
                table=table,
                seq=next(self._seq),
                base=state.kv_len,
                tokens=state.tail + prompt[shared:],
                stats=TurnStats(prompt_tokens=len(prompt), shared_tokens=shared, arrival_s=now),
                generator=make_generator(turn.sampling, self.device),
                on_token=on_token,
                chain=chain,
                guide=guide,
                rank=state.job_since if self.config.job_order else now,
            )
            state.tail = []
            if self.owns_history:
                self.history.append(state.id, list(turn.prompt_token_ids))
            self.counters.prompt_tokens += len(turn.prompt_token_ids)
            self.scheduler.add(req, prefetch)
            return req

    # ---- prefetch ----------------------------------------------------------------------------

    def prefetch(self, conversation_id: str) -> None:
        """The user of an idle conversation is typing: the scheduler's prefetch starts
        bringing its context back to the GPU tier at low priority (`engine/prefetch.py`; a
        no-op for unknown, busy or prefetching conversations, the baseline modes, a context
        all on the GPU)."""
        with self.lock:
            state = self.streams.get(conversation_id)
            if state is None or conversation_id in self.claims:  # unknown, or its turn is here
                return
            now = self.now()
            if self.scheduler.hint(state, next(self._seq), now):
                self.clock.touch(conversation_id, now)  # its chunks are worth keeping now

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
            if child_id in self.streams or self.cache.find(child_id) is not None:
                raise ValueError(f"conversation {child_id!r} exists already")
            parent = self.streams.get(parent_id)
            table = self.cache.find(parent_id)
            cs = self.cache.chunk_size
            if (
                parent is None
                or table is None
                or parent_id in self.claims
                or (parent_len is not None and parent.length != parent_len)
                or len(token_ids) > parent.length
            ):
                return 0
            chain = chain_hashes(list(token_ids), cs)
            linked = self.cache.fork(table, child_id, chain, parent.kv_len)
            if not linked:
                return 0
            full = len(token_ids) // cs * cs
            self.streams[child_id] = StreamState(
                child_id, length=len(token_ids), kv_len=linked, tail=list(token_ids[linked:]),
                hashes=chain[: full // cs], unhashed=list(token_ids[full:]),
            )  # fmt: skip
            if self.owns_history:
                self.history.append(child_id, list(token_ids))
            self.clock.touch(child_id, self.now())
            return linked

    def rewrite(self, conversation_id: str, keep: int, token_ids: list[int], length: int) -> bool:
        """Replace the stream's tokens after its first `keep` with `token_ids`, whose KV the
        next turn computes: a thinking reply re-encoded as the chat template renders it in
        history. `length`: the stream's length in the caller's history before the change.
        False (nothing changed) for an unknown or busy conversation, or another length."""
        with self.lock:
            state = self.streams.get(conversation_id)
            if (
                state is None
                or conversation_id in self.claims
                or state.length != length
                or not 0 <= keep <= length
            ):
                return False
            self.scheduler.supersede(conversation_id, keep=False)  # its context changes
            resync(state, keep, self.cache)  # the cut, as when a caller's history is shorter
            extend_hashes(state, keep, list(token_ids), None, self.cache.chunk_size)
            state.tail += token_ids
            state.length += len(token_ids)
            if self.owns_history:
                self.history.truncate(conversation_id, keep)
                self.history.append(conversation_id, list(token_ids))
            self.counters.reencoded_tokens += len(token_ids)
            return True

    def seed(self, seeds: Iterable[Seed]) -> None:
        """Place conversations in the tiers as a given state says, without running their
        turns (`engine/seed.py`): each one's next turn goes on from there. For measurement:
        the KV of a chunk placed on a tier is not computed. All or none; ValueError while
        turns are in flight, for a conversation held already or a residency this engine
        cannot hold."""
        with self.lock:
            plant(self, seeds)

    def tools_called(self, conversation_id: str, tools: list[str]) -> None:
        """The conversation's last turn ended calling `tools`: it waits for their results,
        expected back in the time those tools took before, its KV held in memory meanwhile
        (`engine/cache/toolwait.py`)."""
        with self.lock:
            state = self.streams.get(conversation_id)
            if state is None or conversation_id in self.claims:
                return
            since = state.idle_since if state.idle_since is not None else self.now()
            policy = self.cache.policy
            if not policy.tools.is_waiting(conversation_id):  # its end was a tool call's
                policy.returns.retract()
            policy.tools.wait(conversation_id, tools, since)
            hold = policy.tools.hold_s() if self.config.tool_holds else None
            if hold is not None:  # most results come back within it: keep its KV till then
                policy.pins.hold(conversation_id, since + hold)
            elif self.config.tool_value:  # most come back within it: kept over idle chats
                policy.expect(conversation_id, since + policy.tools.expect_s())

    def unpin(self, conversation_id: str) -> None:
        """Let the conversation's pin and priority go at once (its client deleted it)."""
        self.cache.policy.pins.release(conversation_id)

    def retained(self, conversation_id: str) -> Retained | None:
        """What the conversation's retention holds now (its pin, until when in wall time; its
        priority; a finished session), for the caller to keep across a restart; None:
        nothing. Thread-safe."""
        return retention.retained(self, conversation_id)

    def restore_retention(self, kept: list[Retained]) -> int:
        """Put back retention `retained` read out before a restart: pins still in force (until
        the same wall time, counted against their owners' caps), priorities, finished
        sessions. Returns the pins put back. Thread-safe."""
        return retention.restore(self, kept)

    def cancel(self, req: Request) -> None:
        req.cancelled = True

    def free(self, conversation_id: str, erase: bool = False) -> None:
        """Forget a conversation's cache (its turns must have ended). `erase`: remove its
        chunks from the disk tier too, and its pin (a deleted conversation's; another
        conversation that starts the same way recomputes what it shared)."""
        with self.lock:
            state = self.streams.get(conversation_id)
            if conversation_id in self.claims:
                raise ConversationBusy(f"conversation {conversation_id!r} has a turn in flight")
            if erase and state is not None and self.disk is not None:
                self.disk.erase(state.hashes)
            self.scheduler.supersede(conversation_id, keep=False)
            self.streams.pop(conversation_id, None)
            self.cache.forget(conversation_id)
            self.cache.policy.tools.forget(conversation_id)
            self.cache.policy.pins.unhold(conversation_id)
            if erase:  # deleted: its pin goes too (a cache reset keeps it for the next turn)
                self.cache.policy.pins.release(conversation_id)
            if self.owns_history:
                self.history.forget(conversation_id)

    # ---- the step loop -----------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._flight is not None

    @property
    def in_flight(self) -> bool:
        """A lagged step was launched and its tokens are not read yet (the next `step` or
        `flush` reads them)."""
        return self._flight is not None

    def step(self) -> list[Request]:
        """Plan and run one batch; returns the turns that ended in it. Lagged (`async_steps`):
        launch this step, then read the previous one's tokens; the turns returned are those
        ended by them (or cancelled, failed, out of room in this call)."""
        self.backend.use_device()  # steps may run on another thread than the one that built it
        with self.lock:
            ended = self._drop_cancelled()
            self.reads.collect(self.scheduler.queued())
            plan = self.scheduler.schedule(swap_in_busy=self.pool.swap_in_busy())
            self.reads.start(plan.reads)
            if self.disk is not None:
                self.disk.spill(self.streams)
            now = self.now()
            for req in plan.failed:  # its history could not be read: that turn alone fails
                log.error("history read for %s failed: %s", req.state.id, req.error)
                self._end(req, FinishReason.ERROR, now)
                ended.append(req)
            if self.ahead:
                flight = self._launch(plan)
                previous, self._flight = self._flight, flight
                ended += self._finish(previous)
                ended += self._end_full(plan)  # after the token in flight: it counts
                if flight is not None:
                    self._run_ahead(flight)
            else:
                ended += self._end_full(plan)
                ended += self._finish(self._launch(plan))
            self._publish(ended)  # after the step's copies: publishing may free blocks
            self.counters.steps += 1
            return ended

    def flush(self) -> list[Request]:
        """Read the tokens of the lagged step in flight, if any, launching none; returns the
        turns they ended."""
        self.backend.use_device()
        with self.lock:
            flight, self._flight = self._flight, None
            ended = self._finish(flight)
            self._publish(ended)
            return ended

    def _publish(self, ended: list[Request]) -> None:
        """First turns that ended share their prompt's full chunks with later conversations."""
        for req in ended:
            if req.chain and req.finish_reason is not FinishReason.ERROR:
                n = req.state.kv_len // self.cache.chunk_size
                self.cache.publish(req.table, req.chain[:n])

    def _launch(self, plan: StepPlan) -> Flight | None:
        """Start the plan's copies and forward (sampling on the device); its pieces' positions
        count as computed from here on (the device runs them in order). Lagged, the tokens
        are not waited for; else they are read before this returns."""
        if not plan.pieces:
            self.pool.begin_step(plan.before)
            self.pool.swap_in_now()  # no forward to pipeline it with
            self.scheduler.computed(plan)
            self.pool.end_step(plan.after)
            return None
        sampled: Sampled | list[int] | None
        if self.ahead:
            last = self._flight
            on_device = None if last is None else last.on_device()
            sampled = self.runner.launch(plan.pieces, plan.before, on_device)
        else:
            sampled = self.runner.step(plan.pieces, plan.before)
        before: dict[Request, int] = {}
        for p in plan.pieces:
            state = p.req.state
            if p.end > state.kv_len:
                before.setdefault(p.req, state.kv_len)
                state.kv_len = p.end
        self.scheduler.computed(plan)
        self.pool.end_step(plan.after)
        return Flight([p.req for p in plan.pieces if p.sample], before, sampled)

    def _finish(self, flight: Flight | None) -> list[Request]:
        """Accept a launched step's tokens (the host waits for them here); returns the turns
        they ended. A turn that ended meanwhile drops its token."""
        if flight is None or not flight.rows:
            return []
        tokens = flight.tokens()
        now = self.now()
        ended = []
        for req, token in zip(flight.rows, tokens, strict=True):
            if req.status == Status.FINISHED:
                continue
            self.counters.generated_tokens += 1
            reason = req.accept(token, now, self.stop_token_ids, self.max_context)
            if reason is not None:
                self._end(req, reason, now)
                ended.append(req)
        return ended

    def _end_full(self, plan: StepPlan) -> list[Request]:
        """Turns with no room to generate more end as if by max_tokens."""
        ended = []
        now = self.now()
        for req in plan.full:
            if req.status == Status.RUNNING:
                self._end(req, FinishReason.LENGTH, now)
                ended.append(req)
        return ended

    def _run_ahead(self, flight: Flight) -> None:
        """Plan the next step before this one's tokens are known: each turn sampling in it
        whose token is not known to be its last gets a placeholder for it. Turns whose next
        step needs a mask from the host (a grammar, min_tokens not reached) go step by step:
        the mask needs the token."""
        limit = self.max_context
        for row, req in enumerate(flight.rows):
            sp = req.turn.sampling
            n = len(req.output) + 1  # with the token in flight
            if (
                req.status == Status.RUNNING
                and req.guide is None
                and sp.min_tokens <= n < sp.max_tokens
                and req.total + 1 < limit
            ):
                req.run_ahead(row)

    def _end(self, req: Request, reason: FinishReason, now: float) -> None:
        self._unwind(req)
        self.scheduler.finish(req, reason)
        self._close(req, now)

    def _unwind(self, req: Request) -> None:
        """`req` ends while a lagged step may hold its next token or positions: the token is
        dropped (`Request.take_back`), and the positions of a running turn do not count as
        computed (its stream's tail keeps them; its next turn computes them again), as if
        that step had not planned it."""
        req.take_back()
        flight = self._flight
        if flight is not None and req.status == Status.RUNNING and req in flight.before:
            req.state.kv_len = flight.before[req]

    def _close(self, req: Request, now: float) -> None:
        """The turn ended: its stream goes on from its tokens, and it is free again."""
        state = req.state
        state.length = req.total
        state.tail = req.tokens[state.kv_len - req.base :]
        self.claims.release(state.id)
        extend_hashes(state, req.base, req.tokens, req.prefix, self.cache.chunk_size)
        req.guide = None  # its matcher is freed with it
        req.stats.finish_s = now
        if not req.output:
            req.stats.first_token_s = now
        self.clock.touch(state.id, now)
        state.idle_since = now
        self.cache.policy.unexpect(state.id)
        self.cache.policy.pins.unhold(state.id)
        self.cache.ended()
        retention.settle(self, req, now)
        if self.owns_history:
            self.history.append(state.id, req.output)

    def _drop_cancelled(self) -> list[Request]:
        ended = []
        now = self.now()
        for req in self.scheduler.turns():
            if req.cancelled and req.status != Status.FINISHED:
                self._end(req, FinishReason.CANCELLED, now)
                ended.append(req)
        return ended

    def fail_all(self, error: BaseException) -> list[Request]:
        """End every turn in flight with `error` (a step failed: the state may be broken);
        returns them."""
        with self.lock:
            for req in self.scheduler.turns():
                try:
                    self._unwind(req)
                except Exception:  # the turn fails regardless
                    log.exception("could not unwind %s", req.state.id)
            self._flight = None  # its tokens are not read: the state may be broken
            failed = self.scheduler.fail_all(error)
            now = self.now()
            for req in failed:
                try:
                    self._close(req, now)
                except Exception:  # the turn is failed regardless
                    log.exception("could not close %s", req.state.id)
                    self.claims.release(req.state.id)
            return failed

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
            now = self.now()
            c, streams, last_active = self.cache, self.streams, self.clock.last_active
            running, waiting = self.scheduler.counts()
            on_disk = self.disk.keys() if self.disk is not None else None  # dropped: "disk"
            held = []
            for t in c.tables.values():
                state = streams.get(t.id)
                d, s, o = t.n_dropped, t.n_shared, t.n_off_gpu
                shared = tuple((x.tier, len(x.holders)) for x in t.chunks[d:s]) if s > d else ()
                disk: tuple[int, ...] = ()
                if on_disk and state is not None:
                    hashes = state.hashes
                    disk = tuple(j for j in range(min(d, len(hashes))) if hashes[j] in on_disk)
                held.append(
                    Held(
                        t.id,
                        0 if state is None else state.length,
                        d,
                        shared,
                        o - s,
                        len(t.chunks) - o,
                        disk,
                        t.pinned,
                        last_active(t.id),
                        c.lowest_value(t, now),
                    )  # fmt: skip
                )
            head = EngineSnapshot(
                device=str(self.device),
                model=self.config.model,
                chunk_size=c.chunk_size,
                cache_mode=self.config.cache_mode,
                eviction=self.config.eviction,
                gpu=PoolUsage(*c.usage("gpu")),
                cpu=PoolUsage(*c.usage("cpu")),
                counters=replace(self.counters, running=running, waiting=waiting),
                conversations=(),
                context_limit=self.context_limit,
                sharing=SharingUsage(*c.sharing_usage()),
                disk=None if self.disk is None else self.disk.usage(),
                pins=retention.usage(self, now),
            )
            return Capture(now, head, tuple(held))

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
