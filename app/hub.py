"""The chats this process serves now: their live sockets, their running turns, one writer of
each chat's history at a time, the per-owner turn quota, and the turn tasks shutdown waits
for."""

from __future__ import annotations

import asyncio
import itertools
import weakref
from collections.abc import Coroutine
from typing import Protocol

# Close codes the hub sends: a newer connection to the chat, the server stopping, the chat
# deleted (as the chat socket refuses a chat it does not know).
REPLACED, GOING_AWAY, UNKNOWN_CHAT = 4409, 1001, 4404


class LiveSocket(Protocol):
    """A live chat socket, as the hub holds it (app/socket/chat.py)."""

    conversation_id: str
    arrival: int  # connection order: the later connection to a chat wins

    async def close(self, code: int, reason: str) -> None: ...


class RunningTurn(Protocol):
    """A chat socket's running turn, as the hub holds it (app/socket/live.py)."""

    conversation_id: str

    def cancel(self) -> None: ...


class Hub:
    """Live chat sockets by conversation: a newer connection replaces the older one."""

    def __init__(self) -> None:
        self._live: dict[str, LiveSocket] = {}
        self._arrivals = itertools.count()
        # One writer of a chat's stored history at a time, across sockets and the API: a turn
        # from reading the history to storing its reply, an edit, items added, a delete. (A
        # second turn in flight is refused by the engine's claims, `engine/stream.py`; this
        # lock keeps the SQL appends of two callers from interleaving.) A lock lives while a
        # writer holds or awaits it.
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._tasks: set[asyncio.Task] = set()  # turns, some still committing after their client
        self._running: dict[str, RunningTurn] = {}  # chat socket turns by conversation

    # --- one history writer per chat -------------------------------------------------------
    def lock(self, conversation_id: str) -> asyncio.Lock:
        """The chat's history lock: hold it to read and then write its stored history."""
        lock = self._locks.get(conversation_id)
        if lock is None:
            lock = self._locks[conversation_id] = asyncio.Lock()
        return lock

    def busy(self, conversation_id: str) -> bool:
        """A socket is connected to the chat, or a writer holds its lock (the replica keeps
        such a chat's home)."""
        lock = self._locks.get(conversation_id)
        return conversation_id in self._live or (lock is not None and lock.locked())

    def track(self, turn: Coroutine) -> asyncio.Task:
        """Run a turn as a task of its own: it may outlive its client (it still commits),
        and shutdown waits for it."""
        task = asyncio.create_task(turn)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- chat sockets and their running turns ----------------------------------------------
    def arrival(self) -> int:
        """Connection order, taken before any await."""
        return next(self._arrivals)

    def sockets(self) -> int:
        return len(self._live)

    def running(self, conversation_id: str) -> RunningTurn | None:
        """The chat socket turn of the conversation, whichever socket started it."""
        return self._running.get(conversation_id)

    def begin(self, turn: RunningTurn) -> None:
        self._running[turn.conversation_id] = turn

    def end(self, turn: RunningTurn) -> None:
        if self._running.get(turn.conversation_id) is turn:
            del self._running[turn.conversation_id]

    async def claim(self, chat: LiveSocket) -> bool:
        """Make `chat` the live socket of its conversation, unless a connection that arrived
        later already is (their auth lookups may finish in either order)."""
        old = self._live.get(chat.conversation_id)
        if old is not None and old.arrival > chat.arrival:
            await chat.close(REPLACED, "replaced by a newer connection")
            return False
        self._live[chat.conversation_id] = chat
        if old is not None:  # a running reply goes on on the newer connection
            await old.close(REPLACED, "replaced by a newer connection")
        return True

    def release(self, chat: LiveSocket) -> None:
        if self._live.get(chat.conversation_id) is chat:
            del self._live[chat.conversation_id]

    async def close_chat(self, conversation_id: str, code: int, reason: str) -> None:
        turn = self._running.get(conversation_id)
        if turn is not None:  # no one will come back to it
            turn.cancel()
        chat = self._live.pop(conversation_id, None)
        if chat is not None:
            await chat.close(code, reason)

    async def drain(self) -> None:
        for turn in list(self._running.values()):
            turn.cancel()
        for chat in list(self._live.values()):
            await chat.close(GOING_AWAY, "server shutting down")
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
