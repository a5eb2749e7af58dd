"""One turn of a chat, whoever asks for it (the chat socket, the OpenAI API): prepare (plan
the prompt from SQL and store the user's message), submit, stream, commit.

The caller is a `Sink`: it receives the reply's text, errors and the final outcome, and
says whether its client still listens. A turn runs under the hub's lock of its
conversation, so no other caller writes the chat's history between its read and its commit;
a second turn in flight is what the engine refuses (`ConversationBusy`, answered `busy`)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Protocol

from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from app.turns import harmony, matching, retention, toolcalls
from app.turns.deps import TurnDeps
from app.turns.detok import Detokenizer
from app.turns.reencode import Reencoded, reencode
from app.turns.request import TurnRequest
from app.turns.window import NoRoom, Plan, plan_turn
from engine.cache.pins import PinRefused
from engine.errors import ConversationBusy, EngineOverloaded
from engine.types import Turn
from store import HistoryConflict

log = logging.getLogger("pensieve.chat")

# A database that is down, blackholed or timing out (as opposed to a bug or bad input).
DB_ERRORS = (DBAPIError, PoolTimeout, TimeoutError, OSError)


@dataclass
class Streamed:
    """What the engine produced for a turn."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: object  # engine TurnStats
    first_token_at: float | None


@dataclass
class Done:
    """A committed turn."""

    message_id: int
    plan: Plan
    out: Streamed
    ttft_s: float
    total_s: float
    reencoded: int = 0  # reply tokens re-encoded as the template renders them in history


class Sink(Protocol):
    """Where a turn's outcome goes. `stream` is the running engine stream (the sink cancels
    it when its client goes or asks to); `open` and `cancelled` stop a turn not yet
    streaming."""

    open: bool
    cancelled: bool
    stream: object | None

    async def error(self, code: str, message: str, **extra) -> None: ...

    async def token(self, text: str) -> None: ...

    async def finish(self, out: Streamed) -> Streamed:
        """The reply as it is to be stored (an API stop string cuts its text)."""

    async def done(self, done: Done) -> None: ...


class ChatTurn:
    """One turn of conversation `conversation_id` for `sink`."""

    def __init__(self, deps: TurnDeps, conversation_id: str, sink: Sink) -> None:
        self.deps = deps
        self.conversation_id = conversation_id
        self.sink = sink

    async def run(self, req: TurnRequest, t0: float, before_turn=None) -> None:
        """The whole turn under the chat's history lock. `before_turn`: an async callable run
        first under the lock (it may change the stored chat); False from it ends the turn."""
        cid = self.conversation_id
        try:
            async with self.deps.hub.lock(cid):
                if before_turn is None or await before_turn():
                    await self._turn(req, t0)
        except DB_ERRORS as e:
            log.warning("database unavailable during a turn of %s: %r", cid, e)
            await self.sink.error(
                "unavailable",
                "the database is unavailable right now; the message was not sent, "
                "try again shortly",
            )
        except Exception:
            log.exception("turn of %s failed", cid)
            await self.sink.error("internal", "the turn failed")

    async def _turn(self, req: TurnRequest, t0: float) -> None:
        prepared = await self._prepare(req)
        if prepared is None:
            return
        plan, message_ids, chain = prepared
        stream = await self._submit(req, plan, message_ids)
        if stream is None:  # refused: what it reserved gives way to the engine's pins
            d = self.deps
            await retention.share(d.pin_caps, d.engine, self.conversation_id, req.retention)
            return
        out = await self._stream(stream)
        if out is not None:
            finished = await self.sink.finish(out)
            if req.tools:
                self._await_tools(finished)
            # a reply a stop string cut is stored as cut: its tokens are not its text
            redo = await self._reencode(plan, out, req.tools) if finished == out else None
            await self._commit(plan, finished, t0, chain, redo)
        # what the turn's end left of the chat's retention, kept across a restart and told
        # to the other replicas
        d = self.deps
        await retention.save(
            d.engine, d.store, d.replica, self.conversation_id, req.retention is not None
        )
        await retention.share(d.pin_caps, d.engine, self.conversation_id, req.retention)

    def _await_tools(self, out: Streamed) -> None:
        """A reply that calls tools: its conversation waits for their results (the eviction
        order keeps it about as long as those tools took before). Told before the client
        hears of the reply, so before its next turn."""
        _, calls = toolcalls.parse(out.text)
        if calls:
            self.deps.engine.tools_called(self.conversation_id, [c.name for c in calls])

    async def _prepare(self, req: TurnRequest) -> tuple[Plan, list[int], str] | None:
        """Plan the prompt from SQL and store the user's message: its tokens are durable
        before the engine sees them, so after a crash the engine recomputes this context
        from SQL, byte for byte. Returns the plan, the ids of the stored messages and the chat's
        prefix hash through them."""
        d, cid, sink = self.deps, self.conversation_id, self.sink
        store = d.store
        conv = await store.get_conversation(cid)
        if conv is None:
            await sink.error("not_found", "this chat no longer exists")
            return None
        history = await store.messages(cid)
        if history and history[-1].role in ("user", "tool") and history[-1].token_ids:
            # The reply of an earlier turn could not be stored (the database went away
            # after its question was): close that turn with an empty `error` reply, so the
            # history stays question/answer pairs and the question is kept. (A user message
            # without tokens was added as an item of the Conversations API: this turn's
            # prompt renders it.)
            await store.append_message(cid, "assistant", "", [], finish_reason="error")
            history = await store.messages(cid)
        try:
            plan = await asyncio.to_thread(
                plan_turn,
                d.engine.tokenizer,
                conv.system_prompt,
                history,
                req.content,
                d.engine.context_limit,
                req.sampling.max_tokens,
                req.max_tokens_given,
                req.before,
                req.role,
                req.tools,
            )
        except NoRoom as e:
            await sink.error("too_long", str(e))
            return None
        req.sampling.max_tokens = plan.max_tokens
        req.sampling.min_tokens = min(req.sampling.min_tokens, plan.max_tokens)  # the window's cut
        if not plan.fresh and plan.context_len < plan.stored_len:
            await store.truncate(cid, plan.context_len)
        pairs = [(m.role, toolcalls.as_sent(m.role, m.content)) for m in history]
        pairs += [*req.before, (req.role, req.content)]
        chain = matching.chain(conv.system_prompt, pairs)[-1]
        start = plan.stored_len if plan.fresh else plan.context_len
        try:
            # Messages the client adds ahead of its own carry no tokens: the user message's
            # prompt renders them all.
            ids = []
            for role, content in req.before:
                m = await store.append_message(cid, role, content, [], expected_start=start)
                ids.append(m.id)
            msg = await store.append_message(
                cid,
                req.role,
                req.content,
                plan.prompt,
                expected_start=start,
                starts_context=plan.fresh,
            )
        except HistoryConflict:  # the chat moved on under us (another server): nothing written
            await sink.error("conflict", "the chat changed meanwhile; send the message again")
            return None
        d.clock.touch(cid)
        return plan, [*ids, msg.id], chain

    async def _submit(self, req: TurnRequest, plan: Plan, message_ids: list[int]):
        """Hand the turn to the engine; a refusal takes the user's message back."""
        engine, cid, sink = self.deps.engine, self.conversation_id, self.sink
        if plan.fresh:  # a new window: the engine's copy of the old one is of no use
            try:
                await engine.free(cid)
            except Exception:  # context_len=0 makes the engine start over anyway
                log.exception("could not free %s", cid)
        turn = Turn(
            cid, plan.prompt, req.sampling, context_len=plan.context_len, retention=req.retention
        )
        refused = await retention.reserve_shared(self.deps.pin_caps, engine, turn)
        if refused is not None:  # over its owner's cap on all replicas together
            await self._take_back(message_ids)
            await sink.error("pin_refused", refused)
            return None
        try:
            stream = engine.submit(turn)
        except EngineOverloaded as e:
            await self._take_back(message_ids)
            wait = e.retry_after_s
            await sink.error(
                "busy", f"the server is busy; try again in {wait:.0f} s", retry_after_s=wait
            )
            return None
        except ConversationBusy as e:
            await self._take_back(message_ids)
            await sink.error("busy", str(e))
            return None
        except PinRefused as e:  # over its owner's cap of pinned bytes
            await self._take_back(message_ids)
            await sink.error("pin_refused", str(e))
            return None
        except (ValueError, RuntimeError) as e:  # bad input, or the engine loop is down
            await self._take_back(message_ids)
            await sink.error("bad_request", str(e))
            return None
        sink.stream = stream
        if sink.cancelled or not sink.open:
            stream.cancel()
        return stream

    async def _take_back(self, message_ids: list[int]) -> None:
        """The engine never saw the messages: remove them (last first), so history stays as
        before."""
        try:
            for message_id in reversed(message_ids):
                await self.deps.store.delete_last_message(self.conversation_id, message_id)
        except DB_ERRORS:  # left as a question without a reply, which the next turn renders
            log.exception("could not take back a refused message of %s", self.conversation_id)

    async def _stream(self, stream) -> Streamed | None:
        """Pass the reply's text on as it comes; None when the turn failed (already
        answered)."""
        engine, sink = self.deps.engine, self.sink
        detok = Detokenizer(
            engine.tokenizer, set(engine.stop_token_ids), harmony.channels(engine.tokenizer)
        )
        first: float | None = None
        try:
            async for token_id in stream:
                if first is None:
                    first = time.perf_counter()
                piece = detok.push(token_id)
                if piece:
                    await sink.token(piece)
        except Exception as e:
            await self._fail()
            if isinstance(e, DB_ERRORS):  # the engine could not read the history back
                log.warning("history read for %s failed: %r", self.conversation_id, e)
                await sink.error(
                    "unavailable", "the database is unavailable right now; try again shortly"
                )
            elif isinstance(e, ValueError):  # refused once the engine saw its state
                await sink.error("rejected", str(e))
            else:
                log.error("engine failed on %s", self.conversation_id, exc_info=e)
                await sink.error("engine_error", str(e))
            return None
        finally:
            sink.stream = None
        tail = detok.flush()
        if tail:
            await sink.token(tail)
        result = stream.result
        return Streamed(
            detok.text(), list(result.token_ids), result.finish_reason, result.stats, first
        )

    async def _fail(self) -> None:
        """The turn produced no reply: close it in SQL with an empty `error` reply, and make
        the engine forget its copy so the next turn rebuilds the context from SQL."""
        cid = self.conversation_id
        try:
            await self.deps.engine.free(cid)
        except Exception:  # the engine recomputes on the next turn's context_len anyway
            log.exception("could not free %s", cid)
        try:
            await self.deps.store.append_message(cid, "assistant", "", [], finish_reason="error")
        except DB_ERRORS:  # a question without a reply: the next turn renders it all the same
            log.warning("could not record the failed turn of %s", cid)

    async def _reencode(self, plan: Plan, out: Streamed, tools) -> Reencoded | None:
        """The turn as the chat template renders it in history, where that differs from
        the tokens generated (a thinking reply: app/turns/reencode.py); None: as generated."""
        d = self.deps
        if not d.reencode_replies or not plan.messages:
            return None
        engine = d.engine
        try:
            return await asyncio.to_thread(
                reencode,
                engine.tokenizer,
                plan.messages,
                plan.stream,
                plan.context_len,
                out.text,
                out.token_ids,
                set(engine.stop_token_ids),
                tools,
            )
        except Exception:  # the stream stays as generated: the next turn cuts it back
            log.exception("could not re-encode the reply of %s", self.conversation_id)
            return None

    async def _commit(
        self, plan: Plan, out: Streamed, t0: float, chain: str, redo: Reencoded | None = None
    ) -> None:
        """Store the reply (with the chat's prefix hash through it), then report it done.
        `redo`: the turn re-encoded as its template renders it in history: the stored
        stream is cut back to where it differs and goes on with those tokens, in SQL and
        in the engine, whose next turn computes them."""
        d, cid = self.deps, self.conversation_id
        start = plan.context_len + len(plan.prompt)
        token_ids = out.token_ids
        try:
            if redo is not None:
                if redo.keep < start:  # the turn's prompt rendered differently too
                    await d.store.truncate(cid, redo.keep)
                start, token_ids = redo.keep, redo.token_ids
            reply = await d.store.append_message(
                cid,
                "assistant",
                out.text,
                token_ids,
                finish_reason=out.finish_reason,
                expected_start=start,
                # a resent copy of a reply with calls is compared in canonical form
                prefix_hash=matching.extend(
                    chain, "assistant", toolcalls.as_sent("assistant", out.text)
                ),
            )
        except Exception as e:
            await d.engine.free(cid)  # SQL lacks the reply the engine holds: recompute from SQL
            if not isinstance(e, DB_ERRORS):
                raise
            log.warning("could not store the reply of %s: %r", cid, e)
            return await self.sink.error(
                "unavailable",
                "the database is unavailable right now; this reply was not saved, "
                "try again shortly",
            )
        reencoded = 0
        if redo is not None:
            generated = plan.context_len + len(plan.prompt) + len(out.token_ids)
            if await d.engine.rewrite(cid, redo.keep, redo.token_ids, generated):
                reencoded = len(redo.token_ids)
            else:  # the engine's copy is not what SQL holds now: rebuilt from SQL
                await d.engine.free(cid)
        d.clock.touch(cid)
        end = time.perf_counter()
        ttft = (out.first_token_at or end) - t0
        d.metrics.observe_turn(ttft, end - t0, out.finish_reason)
        await self.sink.done(Done(reply.id, plan, out, ttft, end - t0, reencoded))
