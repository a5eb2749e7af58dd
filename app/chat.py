"""The chat WebSocket: one live connection per chat, turns streamed token by token."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import time
import weakref
from dataclasses import dataclass

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from app.auth import origin_allowed, owner_token
from app.detok import Detokenizer
from app.prompt import chat_messages, render_delta
from engine.types import SamplingParams, Turn
from store import HistoryConflict

log = logging.getLogger("pensieve.chat")

# Close codes of the chat socket.
NO_CREDENTIALS, NOT_OWNER, UNKNOWN_CHAT, REPLACED = 4401, 4403, 4404, 4409
BAD_ORIGIN = 4403


class BadFrame(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Request:
    content: str
    sampling: SamplingParams
    max_tokens_given: bool


def _number(frame: dict, key: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
    if key not in frame or frame[key] is None:
        return None
    value = frame[key]
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > hi or value < lo or (lo_open and value == lo):
        left = "(" if lo_open else "["
        raise BadFrame(
            "bad_sampling", f"{key} must be a number in {left}{lo}, {hi}], got {value!r}"
        )
    return float(value)


def _integer(frame: dict, key: str, lo: int, hi: int) -> int | None:
    if key not in frame or frame[key] is None:
        return None
    value = frame[key]
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise BadFrame("bad_sampling", f"{key} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def parse_message(frame: dict, max_chars: int, default_tokens: int, limit_tokens: int) -> Request:
    """Validate a `message` frame; every refusal names the field."""
    content = frame.get("content")
    if not isinstance(content, str) or not content.strip():
        raise BadFrame("bad_content", "content must be a non-empty string")
    if len(content) > max_chars:
        raise BadFrame(
            "too_long", f"content has {len(content)} characters, the limit is {max_chars}"
        )
    max_tokens = _integer(frame, "max_tokens", 1, limit_tokens)
    temperature = _number(frame, "temperature", 0.0, 2.0)
    top_p = _number(frame, "top_p", 0.0, 1.0, lo_open=True)
    seed = _integer(frame, "seed", 0, 2**63 - 1)
    sampling = SamplingParams(
        max_tokens=max_tokens or default_tokens,
        temperature=0.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        seed=seed,
    )
    return Request(content, sampling, max_tokens is not None)


def context_limit(engine) -> int:
    """Most tokens one chat can hold: the model's positions, and the whole GPU tier (a turn's
    context must fit there while it runs)."""
    snap = engine.snapshot()
    gpu = snap.get("pools", {}).get("gpu", {}).get("total")
    if not gpu:
        return engine.max_context
    return min(engine.max_context, gpu * snap.get("chunk_size", 32) - 1)


class Hub:
    """Live chat sockets by conversation: a newer connection replaces the older one."""

    def __init__(self) -> None:
        self.live: dict[str, ChatSocket] = {}
        self.arrivals = itertools.count()  # connection order, taken before any await
        # One turn at a time per chat, across sockets; a lock lives while a turn holds or
        # awaits it.
        self.locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self.turns: set[asyncio.Task] = set()  # turns still committing after their socket went

    def lock(self, conversation_id: str) -> asyncio.Lock:
        lock = self.locks.get(conversation_id)
        if lock is None:
            lock = self.locks[conversation_id] = asyncio.Lock()
        return lock

    async def claim(self, chat: ChatSocket) -> bool:
        """Make `chat` the live socket of its conversation, unless a connection that arrived
        later already is (their auth lookups may finish in either order)."""
        old = self.live.get(chat.conversation_id)
        if old is not None and old.arrival > chat.arrival:
            await chat.close(REPLACED, "replaced by a newer connection")
            return False
        self.live[chat.conversation_id] = chat
        if old is not None:
            await old.close(REPLACED, "replaced by a newer connection")
        return True

    def release(self, chat: ChatSocket) -> None:
        if self.live.get(chat.conversation_id) is chat:
            del self.live[chat.conversation_id]

    async def close_chat(self, conversation_id: str, code: int, reason: str) -> None:
        chat = self.live.pop(conversation_id, None)
        if chat is not None:
            await chat.close(code, reason)

    async def drain(self) -> None:
        for chat in list(self.live.values()):
            await chat.close(1001, "server shutting down")
        if self.turns:
            await asyncio.gather(*self.turns, return_exceptions=True)


class ChatSocket:
    def __init__(self, ws: WebSocket, services, conversation_id: str, arrival: int = 0) -> None:
        self.ws = ws
        self.arrival = arrival
        self.sv = services
        self.conversation_id = conversation_id
        self.turn: asyncio.Task | None = None
        self.stream = None  # the engine stream of the running turn
        self.cancelled = False  # a cancel came for the current turn (maybe before its stream)
        self.open = True
        self._send_lock = asyncio.Lock()

    # --- socket plumbing -------------------------------------------------------------
    async def send(self, frame: dict) -> None:
        if not self.open:
            return
        try:
            async with self._send_lock:
                await self.ws.send_text(json.dumps(frame, ensure_ascii=False))
        except (WebSocketDisconnect, RuntimeError, OSError):
            self._gone()

    async def error(self, code: str, message: str) -> None:
        await self.send({"type": "error", "code": code, "message": message})

    def _gone(self) -> None:
        """The client went away: its running turn stops within a step."""
        self.open = False
        if self.stream is not None:
            self.stream.cancel()

    async def close(self, code: int, reason: str) -> None:
        was_open = self.open
        self._gone()
        if was_open and self.ws.application_state == WebSocketState.CONNECTED:
            try:
                async with self._send_lock:
                    await self.ws.close(code=code, reason=reason)
            except (RuntimeError, OSError):
                pass

    # --- the connection --------------------------------------------------------------
    async def serve(self) -> None:
        hub = self.sv.hub
        if not await hub.claim(self):
            return
        try:
            while self.open:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                if msg.get("text") is None:
                    await self.error("binary", "binary frames are not accepted; send JSON text")
                    continue
                await self.handle(msg["text"])
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass
        finally:
            self._gone()
            hub.release(self)

    async def handle(self, text: str) -> None:
        try:
            frame = json.loads(text)
        except ValueError:
            return await self.error("bad_json", "frames must be JSON objects")
        if not isinstance(frame, dict):
            return await self.error("bad_json", "frames must be JSON objects")
        kind = frame.get("type")
        if kind == "typing":
            self.sv.clock.touch(self.conversation_id)
        elif kind == "cancel":
            self.cancelled = True
            if self.stream is not None:
                self.stream.cancel()
        elif kind == "message":
            st = self.sv.settings
            try:
                req = parse_message(
                    frame, st.max_message_chars, st.max_tokens_default, st.max_tokens_limit
                )
            except BadFrame as e:
                return await self.error(e.code, str(e))
            if self.turn is not None and not self.turn.done():
                return await self.error("busy", "a reply is still being generated; cancel it first")
            self.cancelled = False
            self.turn = asyncio.create_task(self.run_turn(req, time.perf_counter()))
            self.sv.hub.turns.add(self.turn)
            self.turn.add_done_callback(self.sv.hub.turns.discard)
        else:
            await self.error("unknown_type", f"unknown frame type {kind!r}")

    # --- one turn --------------------------------------------------------------------
    async def run_turn(self, req: Request, t0: float) -> None:
        try:
            async with self.sv.hub.lock(self.conversation_id):
                await self._turn(req, t0)
        except Exception:
            log.exception("turn of %s failed", self.conversation_id)
            await self.error("internal", "the turn failed")

    async def _fail(self) -> None:
        """The turn produced no reply: close it in SQL with an empty `error` reply, and make
        the engine forget its copy so the next turn rebuilds the context from SQL."""
        try:
            await self.sv.engine.free(self.conversation_id)
        except Exception:  # the engine recomputes on the next turn's context_len anyway
            log.exception("could not free %s", self.conversation_id)
        await self.sv.store.append_message(
            self.conversation_id, "assistant", "", [], finish_reason="error"
        )

    async def _turn(self, req: Request, t0: float) -> None:
        sv, cid = self.sv, self.conversation_id
        engine, store = sv.engine, sv.store
        conv = await store.get_conversation(cid)
        if conv is None:
            return await self.error("not_found", "this chat no longer exists")
        history = await store.messages(cid)
        stored = await store.stream(cid)
        messages = chat_messages(
            conv.system_prompt, [(m.role, m.content) for m in history], req.content
        )
        delta = await asyncio.to_thread(render_delta, engine.tokenizer, messages, stored)
        limit = context_limit(engine)
        room = limit - delta.context_len - len(delta.token_ids)
        sampling = req.sampling
        if room < 1 or (req.max_tokens_given and sampling.max_tokens > room):
            return await self.error(
                "context_full",
                f"the chat holds {delta.context_len} tokens and the message {len(delta.token_ids)}; "
                f"a chat can hold {limit} tokens here ({max(room, 0)} left for a reply)",
            )
        sampling.max_tokens = min(sampling.max_tokens, room)

        # The user's tokens are durable before the engine sees them: after a crash the
        # engine recomputes this context from SQL, byte for byte.
        if delta.context_len < len(stored):
            await store.truncate(cid, delta.context_len)
        try:
            await store.append_message(
                cid, "user", req.content, delta.token_ids, expected_start=delta.context_len
            )
        except HistoryConflict:  # the chat moved on under us (another server): nothing written
            return await self.error(
                "conflict", "the chat changed meanwhile; send the message again"
            )
        sv.clock.touch(cid)
        turn = Turn(cid, delta.token_ids, sampling, context_len=delta.context_len)
        try:
            stream = engine.submit(turn)
        except Exception as e:  # refused: ValueError, ConversationBusy
            await self._fail()
            busy = type(e).__name__ == "ConversationBusy"
            return await self.error("busy" if busy else "bad_request", str(e))
        self.stream = stream
        if self.cancelled or not self.open:
            stream.cancel()

        detok = Detokenizer(engine.tokenizer, set(engine.stop_token_ids))
        first: float | None = None
        try:
            async for token_id in stream:
                if first is None:
                    first = time.perf_counter()
                piece = detok.push(token_id)
                if piece:
                    await self.send({"type": "token", "text": piece})
        except Exception as e:
            # ValueError: refused once the engine saw its state (e.g. the chat outgrew the
            # cache); anything else is a failure of the step.
            refused = isinstance(e, ValueError)
            if not refused:
                log.exception("engine failed on %s", cid)
            await self._fail()
            return await self.error("rejected" if refused else "engine_error", str(e))
        finally:
            self.stream = None
        tail = detok.flush()
        if tail:
            await self.send({"type": "token", "text": tail})

        result = stream.result
        end = time.perf_counter()
        try:
            reply = await store.append_message(
                cid,
                "assistant",
                detok.text(),
                list(result.token_ids),
                finish_reason=result.finish_reason,
                expected_start=delta.context_len + len(delta.token_ids),
            )
        except Exception:
            await engine.free(cid)  # SQL lacks the reply the engine holds: recompute from SQL
            raise
        sv.clock.touch(cid)
        s = result.stats
        ttft = (first or end) - t0
        sv.metrics.observe_turn(ttft, end - t0, result.finish_reason)
        await self.send(
            {
                "type": "done",
                "message_id": reply.id,
                "finish_reason": result.finish_reason,
                "usage": {
                    "prompt_tokens": len(delta.token_ids),
                    "completion_tokens": len(result.token_ids),
                    "cached_tokens": s.cached_tokens,
                    "swapped_in_tokens": s.swapped_in_tokens,
                    "recomputed_tokens": s.recomputed_tokens,
                },
                "timing": {
                    "ttft_ms": round(ttft * 1000, 1),
                    "total_ms": round((end - t0) * 1000, 1),
                },
            }
        )


async def chat_endpoint(ws: WebSocket) -> None:
    """Authenticate, authorize, then hand the socket to a ChatSocket.

    Refusals close the handshake with an application close code (4401/4403/4404); a
    close before accept reaches the client as HTTP 403, so the socket is accepted first."""
    sv = ws.app.state.services
    cid = ws.path_params["conversation_id"]
    arrival = next(sv.hub.arrivals)
    await ws.accept()
    if not origin_allowed(ws, sv.settings.allowed_origins):
        return await ws.close(BAD_ORIGIN, "origin not allowed")
    token = owner_token(ws)
    owner = await sv.store.user_by_token(token) if token else None
    if owner is None:
        return await ws.close(NO_CREDENTIALS, "no valid credentials")
    conv = await sv.store.get_conversation(cid)
    if conv is None:
        return await ws.close(UNKNOWN_CHAT, "unknown chat")
    if conv.owner_id != owner.id:
        return await ws.close(NOT_OWNER, "not your chat")
    await ChatSocket(ws, sv, cid, arrival).serve()
