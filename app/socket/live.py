"""A chat socket's turn, which outlives the socket that started it.

The turn (`ChatTurn`) streams into a `LiveTurn`, which keeps the reply's text so far and
passes every frame on to the chat's current socket. When that socket goes away the turn
goes on for a grace period (`resume_grace_s`): a client that reconnects to the chat within
it takes the turn over (`attach`): it gets a `resume` frame with the text so far, then the
rest of the stream on the new socket. One turn, one consumer: the latest socket. If no
socket comes back in time the turn is cancelled, as a disconnect did before, and its
partial reply is committed."""

from __future__ import annotations

import asyncio
import logging

from app.turns.pipeline import Done, Streamed

log = logging.getLogger("pensieve.chat")


class LiveTurn:
    """The `Sink` of a chat socket's turn; `socket` is whoever listens now (or None)."""

    def __init__(self, conversation_id: str, socket, grace_s: float) -> None:
        self.conversation_id = conversation_id
        self.socket = socket  # a ChatSocket, or None while no client is connected
        self.grace_s = grace_s
        self.pieces: list[str] = []  # the reply's text so far, as sent
        self.stream = None  # the engine stream, while it runs (set by ChatTurn)
        self.cancelled = False
        self.open = True  # False once no client came back in time
        self._timer: asyncio.TimerHandle | None = None

    # --- who listens -----------------------------------------------------------------
    async def attach(self, socket) -> None:
        """`socket` (a newer connection to the chat) takes the turn over: the text so far,
        then the rest. No await before the frame is queued, so no token slips in between."""
        self._stop_timer()
        self.socket = socket
        await socket.send({"type": "resume", "text": "".join(self.pieces)})

    def detach(self, socket) -> None:
        """`socket` went away: the turn waits `grace_s` for a client to come back."""
        if self.socket is not socket:
            return  # already replaced by a newer connection
        self.socket = None
        if self.grace_s <= 0:
            return self._abandon()
        if self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.grace_s, self._abandon)

    def _abandon(self) -> None:
        self._timer = None
        if self.socket is None:
            log.info("no client came back to %s: its turn stops", self.conversation_id)
            self.open = False
            self.cancel()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def cancel(self) -> None:
        """Stop the turn (within a step once it streams; before it does, at submit)."""
        self.cancelled = True
        if self.stream is not None:
            self.stream.cancel()

    def ended(self) -> None:
        self._stop_timer()

    # --- Sink ------------------------------------------------------------------------
    async def error(self, code: str, message: str, **extra) -> None:
        if self.socket is not None:
            await self.socket.error(code, message, **extra)

    async def token(self, text: str) -> None:
        self.pieces.append(text)
        if self.socket is not None:
            await self.socket.send({"type": "token", "text": text})

    async def finish(self, out: Streamed) -> Streamed:
        return out

    async def done(self, done: Done) -> None:
        if self.socket is not None:
            await self.socket.send(done_frame(done))


def done_frame(done: Done) -> dict:
    out, s = done.out, done.out.stats
    return {
        "type": "done",
        "message_id": done.message_id,
        "finish_reason": out.finish_reason,
        "turns_left_out": done.plan.turns_left_out,
        "usage": {
            "prompt_tokens": len(done.plan.prompt),
            "completion_tokens": len(out.token_ids),
            "cached_tokens": s.cached_tokens,
            "swapped_in_tokens": s.swapped_in_tokens,
            "recomputed_tokens": s.recomputed_tokens,
            "prefetched_tokens": s.prefetched_tokens,
            "disk_tokens": s.disk_tokens,
            "reencoded_tokens": done.reencoded,
        },
        "timing": {
            "ttft_ms": round(done.ttft_s * 1000, 1),
            "total_ms": round(done.total_s * 1000, 1),
        },
    }
