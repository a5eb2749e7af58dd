"""The asyncio front of the engine: the step loop runs in its own thread, tokens stream back.

The loop thread hands its results to the event loop once a step: the step's tokens of every
turn, then the turns that ended, in one `call_soon_threadsafe` (not one per token: each is
a wake-up of the event loop). Every 0.2 s it captures the facts of a snapshot under the
engine's lock (`Engine.capture`, O(1) a conversation); the snapshot itself is built from
them on the event loop, and only when something asks for it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from engine import warm
from engine.cache.pins import Retained
from engine.drain import DrainRate
from engine.engine import Engine
from engine.persistence import ActivityClock, TokenHistory
from engine.request import Request
from engine.snapshot import Capture, EngineSnapshot
from engine.types import EngineConfig, Turn, TurnResult

log = logging.getLogger(__name__)

_END = object()
SNAPSHOT_EVERY_S = 0.2
IDLE_WRITES = 16  # chunks written to the disk tier per turn of an idle loop


class TurnStream:
    """Async iterator over a turn's sampled token ids; `result` once it has ended."""

    def __init__(self, owner: AsyncEngine, turn: Turn) -> None:
        self.turn = turn
        self.result: TurnResult | None = None
        self.error: BaseException | None = None
        self._owner = owner
        self._queue: asyncio.Queue = asyncio.Queue()
        self.request: Request | None = None  # set by the loop thread once submitted

    def __aiter__(self) -> TurnStream:
        return self

    async def __anext__(self) -> int:
        item = await self._queue.get()
        if item is _END:
            self._queue.put_nowait(_END)  # iterating again ends again
            if self.error is not None:
                raise self.error
            raise StopAsyncIteration
        return item

    def cancel(self) -> None:
        """Stop the turn; it ends within a step with finish_reason "cancelled"."""
        self._owner._post(("cancel", self))

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        history: TokenHistory | None = None,
        clock: ActivityClock | None = None,
        engine: Engine | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self._history, self._clock = history, clock
        self.engine = engine
        self._owns_engine = engine is None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._in_flight = 0  # turns submitted here and not ended (event loop only)
        self._running = 0  # turns in the running batch, as the loop thread last saw it
        self.drain = DrainRate()  # how fast turns end: the wait a refused turn is told
        self._crashed: BaseException | None = None
        self._written_at = -1  # the step count when idle write-back last found nothing to do
        self._capture: Capture | None = None  # the latest, written by the loop thread
        self._captured_at = 0.0
        self._built: tuple[Capture, EngineSnapshot] | None = None  # built from it, when asked
        self._tokens: list[tuple[TurnStream, int]] = []  # this step's, for the event loop

    # ---- life cycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Start the loop thread; it builds the engine (unless one was given), then steps it.

        One thread does both on purpose. On the CPU every thread that runs a parallel torch
        op keeps an OpenMP team for the life of the thread, and once the process holds more
        OpenMP threads than cores, libgomp has idle ones sleep almost at once instead of
        spinning: each of a step's ~500 parallel regions then waits for its workers to be
        woken. A model loaded on one thread and stepped on another made every decode step
        about 35% slower on 2 cores (docs/internals.md, "One thread for the model")."""
        self._loop = asyncio.get_running_loop()
        built = self._loop.create_future()
        self._thread = threading.Thread(
            target=self._run, args=(built,), name="engine-loop", daemon=True
        )
        self._thread.start()
        await built

    async def warm_up(self, prompt: list[int]) -> list[int] | None:
        """One tiny turn on `prompt` before serving, so the first real turn does not pay the
        one-time costs of a first forward (engine/warm.py); it leaves no trace. Returns the
        tokens it generated, or None where a warm-up is pointless (a simulated device)."""
        if not warm.needed(self.config):
            return None
        tallies = await self._on_loop(warm.Tallies.of, self.engine)
        result = await self.generate(warm.warm_turn(prompt))
        await self.free(warm.WARM_ID, erase=True)
        await self._on_loop(self._forget_warm_up, tallies)
        return list(result.token_ids)

    def _forget_warm_up(self, tallies: warm.Tallies) -> None:
        tallies.put_back(self.engine)
        self.drain = DrainRate()
        self._refresh_snapshot(force=True)

    async def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        if self.engine is not None and self._owns_engine:
            self.engine.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self.engine.stop_token_ids

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    @property
    def context_limit(self) -> int:
        """Most tokens one conversation can hold (see `Engine.context_limit`)."""
        return self.engine.context_limit

    @property
    def alive(self) -> bool:
        """The step loop is running and has not crashed."""
        thread = self._thread
        return (
            thread is not None
            and thread.is_alive()
            and self._crashed is None
            and not self._stop.is_set()
        )

    @property
    def queued(self) -> int:
        """Turns submitted and not yet running (as of the last step)."""
        return max(0, self._in_flight - self._running)

    # ---- requests ----------------------------------------------------------------------------

    def submit(self, turn: Turn) -> TurnStream:
        """Queue a turn. Raises ValueError for bad input, ConversationBusy if one is in
        flight, EngineOverloaded if `max_waiting` turns are queued already. The engine checks
        and claims it here (`Engine.accept`), once; the loop thread only queues it."""
        if self._thread is None:
            raise RuntimeError("the engine is not started")
        if not self.alive:
            raise RuntimeError("the engine loop is not running")
        # the wait a refused turn is told: from the queue's drain rate
        self.engine.accept(turn, self.queued, lambda q: self.drain.wait_s(q, time.monotonic()))
        self._in_flight += 1
        stream = TurnStream(self, turn)
        self._post(("submit", stream))
        return stream

    async def generate(self, turn: Turn) -> TurnResult:
        stream = self.submit(turn)
        async for _ in stream:
            pass
        return stream.result

    def free(self, conversation_id: str, erase: bool = False) -> asyncio.Future:
        """Forget a conversation's cache (`erase`: its disk tier files too, a deleted
        chat's); await the result to know it is done."""
        return self._on_loop(self.engine.free, conversation_id, erase)

    def fork(
        self, parent_id: str, child_id: str, token_ids: list[int], parent_len: int | None = None
    ) -> asyncio.Future:
        """Start `child_id` on the parent's first tokens, linking the parent's chunks (see
        `Engine.fork`); await the positions linked (0: the child recomputes)."""
        return self._on_loop(self.engine.fork, parent_id, child_id, list(token_ids), parent_len)

    def rewrite(
        self, conversation_id: str, keep: int, token_ids: list[int], length: int
    ) -> asyncio.Future:
        """Replace the stream's tokens after `keep` with `token_ids` (see `Engine.rewrite`);
        await True, or False where nothing changed."""
        return self._on_loop(self.engine.rewrite, conversation_id, keep, list(token_ids), length)

    def seed(self, seeds) -> asyncio.Future:
        """Place conversations in the tiers as a given state says, on the loop thread (see
        `Engine.seed`: for measurement; refused while turns are in flight); await it."""
        return self._on_loop(self.engine.seed, list(seeds))

    def _on_loop(self, fn, *args) -> asyncio.Future:
        """Call `fn(*args)` (an engine method) on the loop thread, between steps; await its
        result (or its exception)."""
        fut = self._loop.create_future()
        self._post(("run", fn, args, fut))
        return fut

    def prefetch(self, conversation_id: str) -> None:
        """The user is typing: bring the conversation's context back to the GPU tier at low
        priority (see `Engine.prefetch`). Cheap, never raises; repeated calls are one."""
        if self.alive and not self.is_busy(conversation_id):
            self._post(("prefetch", conversation_id))

    def tools_called(self, conversation_id: str, tools: list[str]) -> None:
        """The conversation's turn ended calling `tools`: it waits for their results (see
        `Engine.tools_called`). Cheap, never raises."""
        if self.alive:
            self._post(("tools", conversation_id, list(tools)))

    def unpin(self, conversation_id: str) -> None:
        """Let the conversation's pin go at once (see `Engine.unpin`; thread-safe)."""
        self.engine.unpin(conversation_id)

    def pin_bytes(self, tokens: int) -> int:
        """What a pin of a conversation `tokens` long counts against its owner's cap (a turn
        reserves for its context, prompt and `max_tokens`)."""
        return self.engine.retainer.size(tokens)

    def retained(self, conversation_id: str) -> Retained | None:
        """What the conversation's retention holds now, in wall time (see `Engine.retained`;
        thread-safe)."""
        return self.engine.retained(conversation_id)

    def restore_retention(self, kept: list[Retained]) -> int:
        """Put back retention kept across a restart (see `Engine.restore_retention`;
        thread-safe); the pins put back."""
        return self.engine.restore_retention(kept)

    @property
    def disk_tier(self) -> bool:
        """The engine keeps a disk tier it writes to (`prompt_cache_retention` needs one)."""
        return self.engine.disk is not None

    def snapshot(self) -> EngineSnapshot:
        """Residency as of at most a fraction of a second ago (never waits for a step)."""
        capture, built = self._capture, self._built
        if capture is None:
            raise RuntimeError("the engine is not started")
        if built is None or built[0] is not capture:
            built = self._built = (capture, capture.build())
        return built[1]

    def announce_disk(self, histories: list[tuple[str, list[int]]]) -> int:
        return self.engine.announce_disk(histories)

    def kv_events(self, full: bool = False) -> list:
        """The engine's KV events since the last call (any thread: the engine's lock)."""
        return self.engine.kv_events(full)

    def metrics(self) -> dict:
        return asdict(self.snapshot().counters)

    def is_busy(self, conversation_id: str) -> bool:
        return conversation_id in self.engine.claims

    # ---- the loop thread ---------------------------------------------------------------------

    def _post(self, item) -> None:
        self._inbox.put(item)
        self._wake.set()

    def _call(self, fn, *args) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fn, *args)

    def _run(self, built: asyncio.Future) -> None:
        try:
            if self.engine is None:
                self.engine = Engine(self.config, self._history, self._clock)
            self._capture = self.engine.capture()
        except BaseException as e:
            self._crashed = e
            self._call(_resolve, built, None, e)
            return
        self._call(_resolve, built, None, None)
        try:
            self._loop_steps()
        except BaseException as e:  # the loop is dead: say so, and end what was in flight
            self._crashed = e
            log.critical("the engine loop stopped: %r", e, exc_info=True)
            self._fail_everything(RuntimeError(f"the engine loop stopped: {e!r}"))

    def _loop_steps(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._drain()
            if engine.has_work():
                try:
                    ended = engine.step()
                except Exception as e:  # a bug, not I/O: fail what was in flight, keep serving
                    log.exception("engine step failed")
                    ended = engine.fail_all(e)
                self._running = engine.scheduler.running_turns()
                self._publish(ended)
                if not ended and not engine.in_flight and not engine.scheduler.counts()[0]:
                    engine.wait_for_io()
            else:
                self._refresh_snapshot(force=True)
                # Idle: write some of what memory holds to the disk tier, so that a crash
                # or a replica's death loses little of it
                if self._write_back(engine):
                    self._wake.wait(0.01)
                else:
                    self._wake.wait(0.5)
                self._wake.clear()
            self._refresh_snapshot()

    def _write_back(self, engine: Engine) -> bool:
        """Some chunks written to the disk tier while idle; False once all are (until the
        next step changes what memory holds)."""
        if engine.disk is None or engine.counters.steps == self._written_at:
            return False
        if engine.write_back(limit=IDLE_WRITES):
            return True
        self._written_at = engine.counters.steps
        return False

    def _fail_everything(self, error: Exception) -> None:
        """After the loop died: fail the engine's turns and those still in the inbox."""
        try:
            self._publish(self.engine.fail_all(error))
        except BaseException:
            log.exception("could not fail the turns in flight")
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "submit":  # accepted, never queued: its claim goes here
                self.engine.claims.release(item[1].turn.conversation_id)
                self._call(self._end, item[1], None, error)
            elif item[0] == "run":
                self._call(_resolve, item[-1], None, error)

    def _drain(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            kind = item[0]
            if kind == "submit":
                stream: TurnStream = item[1]
                self._submit(stream)
            elif kind == "cancel":
                req = item[1].request
                if req is not None:
                    self.engine.cancel(req)
            elif kind == "prefetch":
                try:
                    self.engine.prefetch(item[1])
                except Exception:  # a hint only: the turn that follows works without it
                    log.exception("prefetch of %s failed", item[1])
            elif kind == "tools":
                try:
                    self.engine.tools_called(item[1], item[2])
                except Exception:  # a hint for the eviction order only
                    log.exception("tool wait of %s failed", item[1])
            elif kind == "run":
                _, fn, args, fut = item
                try:
                    self._call(_resolve, fut, fn(*args), None)
                except Exception as e:
                    self._call(_resolve, fut, None, e)

    def _submit(self, stream: TurnStream) -> None:
        def on_token(token: int) -> None:  # on the loop thread, during a step
            self._tokens.append((stream, token))

        try:
            req = self.engine.submit(stream.turn, on_token=on_token, accepted=True)
        except Exception as e:
            self._call(self._end, stream, None, e)
            return
        req.handle = stream
        stream.request = req

    def _publish(self, ended: list[Request]) -> None:
        """Hand the step's tokens, then its ended turns, to the event loop in one call."""
        tokens, self._tokens = self._tokens, []
        ends = []
        now = time.monotonic()
        for req in ended:
            self.drain.ended(now)
            stream: TurnStream | None = req.handle
            if stream is not None:
                error = req.error
                ends.append((stream, None if error else req.result(), error))
        if tokens or ends:
            self._call(self._deliver, tokens, ends)

    def _deliver(self, tokens: list[tuple[TurnStream, int]], ends: list[tuple]) -> None:
        # On the event loop: every token before its turn's end.
        for stream, token in tokens:
            stream._queue.put_nowait(token)
        for end in ends:
            self._end(*end)

    def _end(
        self, stream: TurnStream, result: TurnResult | None, error: BaseException | None
    ) -> None:
        # On the event loop (the engine released the conversation when the turn ended).
        self._in_flight -= 1
        stream.result, stream.error = result, error
        stream._queue.put_nowait(_END)

    def _refresh_snapshot(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._captured_at >= SNAPSHOT_EVERY_S:
            self._capture = self.engine.capture()
            self._captured_at = now


def built_apart(config: EngineConfig) -> Engine:
    """An Engine built on a thread that ends once it is built, for a caller that hands it to
    an AsyncEngine later: the thread's OpenMP team ends with it, where the caller's own would
    stay and slow the loop thread's steps (see `AsyncEngine.start`)."""
    with ThreadPoolExecutor(1, thread_name_prefix="engine-build") as pool:
        return pool.submit(Engine, config).result()


def _resolve(fut: asyncio.Future, value, error) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)
