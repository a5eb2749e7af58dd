"""The chat WebSocket: one live connection per chat, turns streamed token by token."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import cast

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from app.auth import origin_allowed, owner_token
from app.hub import UNKNOWN_CHAT
from app.services import Services, services
from app.socket.frames import BadFrame, parse_edit, parse_json, parse_message, parse_regenerate
from app.socket.live import LiveTurn
from app.turns import edits
from app.turns.pipeline import DB_ERRORS, ChatTurn
from app.turns.request import TurnRequest
from app.turns.retention import NoDiskTier, retention_of

log = logging.getLogger("pensieve.chat")

# Close codes of the chat socket; 4409 (replaced by a newer connection) and 4404 (unknown
# chat) are the hub's.
NO_CREDENTIALS, NOT_OWNER = 4401, 4403
BAD_ORIGIN = 4403
TRY_AGAIN_LATER = 1013

# The socket went away under a send or a close.
GONE = (WebSocketDisconnect, RuntimeError, OSError)

__all__ = ["BadFrame", "ChatSocket", "chat_endpoint", "parse_message", "ws_max_size"]


def ws_max_size(max_message_chars: int) -> int:
    """Largest frame to accept: every character of the content may be an astral one that
    JSON escapes as a surrogate pair (`\\ud83d\\ude00`, 12 bytes), plus the other fields."""
    return 12 * max_message_chars + 4096


async def safe_close(ws: WebSocket, code: int, reason: str) -> None:
    """Close the socket; a client that already left is no error."""
    if ws.application_state == WebSocketState.DISCONNECTED:
        return
    with contextlib.suppress(*GONE):
        await ws.close(code=code, reason=reason)


class ChatSocket:
    def __init__(
        self,
        ws: WebSocket,
        sv: Services,
        conversation_id: str,
        arrival: int = 0,
        owner_id: str = "",
    ) -> None:
        self.ws = ws
        self.arrival = arrival
        self.sv = sv
        self.conversation_id = conversation_id
        self.owner_id = owner_id
        self.open = True
        self._send_lock = asyncio.Lock()

    # --- socket plumbing -------------------------------------------------------------
    async def send(self, frame: dict) -> None:
        if not self.open:
            return
        try:
            async with self._send_lock:
                await self.ws.send_text(json.dumps(frame, ensure_ascii=False))
        except GONE:
            self._gone()

    async def error(self, code: str, message: str, **extra) -> None:
        await self.send({"type": "error", "code": code, "message": message, **extra})

    @property
    def turn(self) -> LiveTurn | None:
        """The chat's running turn, whichever socket started it."""
        return cast("LiveTurn | None", self.sv.hub.running(self.conversation_id))

    def _gone(self) -> None:
        """The client went away: the chat's running turn waits a while for it to come back
        (see app/socket/live.py)."""
        self.open = False
        if self.turn is not None:
            self.turn.detach(self)

    async def close(self, code: int, reason: str) -> None:
        """Close the connection; never raises (the client may be leaving at the same time)."""
        was_open = self.open
        self._gone()
        if was_open:
            async with self._send_lock:
                await safe_close(self.ws, code, reason)

    # --- the connection --------------------------------------------------------------
    async def serve(self) -> None:
        hub = self.sv.hub
        try:
            if not await hub.claim(self):
                return
            if self.turn is not None:  # a reconnect while the chat's reply runs: take it over
                await self.turn.attach(self)
            while self.open:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                if msg.get("text") is None:
                    await self.error("binary", "binary frames are not accepted; send JSON text")
                    continue
                await self.handle(msg["text"])
        except GONE:
            pass
        finally:
            self._gone()
            hub.release(self)

    async def handle(self, text: str) -> None:
        try:
            frame = parse_json(text)
        except BadFrame as e:
            return await self.error(e.code, str(e))
        kind = frame.get("type")
        if kind == "typing":
            self.sv.clock.touch(self.conversation_id)
            self._prefetch()
        elif kind == "cancel":
            if self.turn is not None:
                self.turn.cancel()
        elif kind in ("message", "edit", "regenerate"):
            await self._start_turn(frame)
        else:
            await self.error("unknown_type", f"unknown frame type {kind!r:.40}")

    def _prefetch(self) -> None:
        """A message is coming: the engine brings the chat's context back to the GPU tier
        meanwhile. A hint: nothing it does reaches the socket."""
        prefetch = getattr(self.sv.engine, "prefetch", None)
        if prefetch is None or self.turn is not None:
            return
        try:
            prefetch(self.conversation_id)
        except Exception:
            log.exception("prefetch of %s failed", self.conversation_id)

    async def _start_turn(self, frame: dict) -> None:
        """A `message`, an `edit` (the chat cut back to before message `seq`, then the new
        content sent) or a `regenerate` (cut back to before the last question, asked again)."""
        st, cid, hub = self.sv.settings, self.conversation_id, self.sv.hub
        live = LiveTurn(cid, self, st.resume_grace_s)
        before = None
        try:
            if frame["type"] == "edit":
                seq, req = parse_edit(
                    frame, st.max_message_chars, st.max_tokens_default, st.max_tokens_limit
                )
            elif frame["type"] == "regenerate":
                req = parse_regenerate(frame, st.max_tokens_default, st.max_tokens_limit)
            else:
                req = parse_message(
                    frame, st.max_message_chars, st.max_tokens_default, st.max_tokens_limit
                )
            req.retention = retention_of(
                self.owner_id, *req.asked, self.sv.engine.disk_tier, st.max_pinned_mb_per_owner
            )
            if frame["type"] == "edit":
                before = edits.edit(self.sv.turn_deps(), cid, seq, live)
            elif frame["type"] == "regenerate":
                before = edits.regenerate(self.sv.turn_deps(), cid, req, live)
        except BadFrame as e:
            return await self.error(e.code, str(e))
        except NoDiskTier as e:
            return await self.error("bad_retention", str(e))
        if self.turn is not None:
            return await self.error("busy", "a reply is still being generated; cancel it first")
        wait = await self.sv.quotas.take("turns", self.owner_id, st.turns_per_minute)
        if wait is not None:
            return await self.error(
                "rate_limited",
                f"at most {st.turns_per_minute} messages a minute; try again in {wait:.0f} s",
                retry_after_s=wait,
            )
        hub.begin(live)
        hub.track(self.run_turn(live, req, time.perf_counter(), before))

    # --- one turn: the shared pipeline, with the chat's live turn as its sink ------------
    async def run_turn(self, live: LiveTurn, req: TurnRequest, t0: float, before_turn=None) -> None:
        try:
            await ChatTurn(self.sv.turn_deps(), self.conversation_id, live).run(
                req, t0, before_turn
            )
        finally:
            live.ended()
            self.sv.hub.end(live)


async def chat_endpoint(ws: WebSocket) -> None:
    """Authenticate, authorize, then hand the socket to a ChatSocket.

    Refusals close the handshake with an application close code (4401/4403/4404); a
    close before accept reaches the client as HTTP 403, so the socket is accepted first.
    A client that leaves at any point ends the handler quietly."""
    with contextlib.suppress(WebSocketDisconnect, OSError):
        await _admit(ws)


async def _admit(ws: WebSocket) -> None:
    sv = services(ws)
    cid = ws.path_params["conversation_id"]
    arrival = sv.hub.arrival()
    await ws.accept()
    if not origin_allowed(ws, sv.settings.allowed_origins):
        return await safe_close(ws, BAD_ORIGIN, "origin not allowed")
    token = owner_token(ws)
    try:
        owner = await sv.store.user_by_token(token) if token else None
        conv = await sv.store.get_conversation(cid) if owner else None
    except DB_ERRORS as e:
        log.warning("database unavailable while admitting a chat socket: %r", e)
        return await safe_close(ws, TRY_AGAIN_LATER, "database unavailable")
    if owner is None:
        return await safe_close(ws, NO_CREDENTIALS, "no valid credentials")
    if conv is None:
        return await safe_close(ws, UNKNOWN_CHAT, "unknown chat")
    if conv.owner_id != owner.id:
        return await safe_close(ws, NOT_OWNER, "not your chat")
    await ChatSocket(ws, sv, cid, arrival, owner.id).serve()
