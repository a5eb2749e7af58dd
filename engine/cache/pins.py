"""Pins: conversations a client asked to keep in memory for a while after their turn
(`Retention.ttl_s`), with a priority that scales their eviction value, counted per owner
against a cap of pinned bytes.

Pure bookkeeping read by the eviction order (`Policy.key`): a pinned chunk sorts after
every unpinned one, and the evictor never drops it (it may move from the GPU to the CPU
tier). A pin past its owner's cap is refused when its turn is accepted; room is never made
by evicting another pin. Expired pins are forgotten when met.

The server holds a conversation the same way, with no client asking, while it waits for a
tool's result (`hold`, see engine/cache/toolwait.py): for a time learned from the tool gaps
seen, renewed once when its next turn comes, let go when that turn ends. A hold counts
against no owner and is not a pin in the stats.

What a conversation's pins hold (its pin, its priority, a finished session) is read out as
`Retained` for the server to keep durably (`record`) and put back after a restart
(`restore`); the `Retainer` converts the engine's clock to wall time for it (engine/cache/retention.py).

The front (the event loop) reserves while the engine's loop thread settles, releases and
reads: changes take a lock, reads of one pin are single dict lookups.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

NEUTRAL = 50  # the priority that leaves a chunk's value as it is


class PinRefused(ValueError):
    """A pin would take its owner past the cap of pinned bytes."""


@dataclass
class Pin:
    owner: str
    ttl_s: float
    until: float  # pinned while now < until
    priority: int
    bytes: int  # what it may hold: its projected size when reserved, its held size once settled


@dataclass(frozen=True)
class Retained:
    """One conversation's pin (`ttl_s` None: none in force), priority and whether its session
    is done, as kept across a restart."""

    conversation_id: str
    owner: str = ""
    ttl_s: float | None = None
    until: float = 0.0  # the pin holds while now < until
    bytes: int = 0  # what the pin counts against its owner's cap
    priority: int = NEUTRAL
    done: bool = False


class Pins:
    def __init__(self) -> None:
        self.pins: dict[str, Pin] = {}
        self.priority: dict[str, int] = {}  # conversations with a non-neutral priority
        self.done: set[str] = set()  # ttl_s 0: the session is over, its chunks go first
        self.holds: dict[str, float] = {}  # the server's holds of tool waits: until when
        self.changes = 0  # the eviction order is stale when this moves
        self._lock = threading.Lock()

    # ---- what the eviction order reads ------------------------------------------------------

    def held(self, conversation_id: str, now: float) -> bool:
        pin = self.pins.get(conversation_id)
        if pin is not None and pin.until > now:
            return True
        return self.holds.get(conversation_id, 0.0) > now

    def holding(self) -> list[str]:
        """Conversations with a pin or a hold, live or not (`held` says which are)."""
        return [*self.pins, *(cid for cid in self.holds if cid not in self.pins)]

    def factor(self, conversation_id: str) -> float:
        """The weight of its eviction value: 0 for a finished session, priority / 50 else."""
        if conversation_id in self.done:
            return 0.0
        return self.priority.get(conversation_id, NEUTRAL) / NEUTRAL

    # ---- changes ------------------------------------------------------------------------------

    def reserve(
        self,
        conversation_id: str,
        owner: str,
        ttl_s: float,
        priority: int,
        size: int,
        cap: int | None,
        now: float,
    ) -> None:
        """Pin the conversation from now for `ttl_s`, holding up to `size` bytes; PinRefused
        if its owner's other live pins and this one would pass `cap`."""
        with self._lock:
            if cap is not None:
                used = self.owner_bytes(owner, now, but=conversation_id)
                if used + size > cap:
                    raise PinRefused(
                        f"retention: pinning this conversation ({size} bytes at most) would "
                        f"take this owner's pinned KV to {used + size} bytes, over the cap "
                        f"of {cap} bytes; let other sessions go (ttl_s 0) or pin less"
                    )
            self.pins[conversation_id] = Pin(owner, ttl_s, now + ttl_s, priority, size)
            self._set_priority(conversation_id, priority)
            self.done.discard(conversation_id)
            self.changes += 1

    def settle(self, conversation_id: str, now: float, size: int) -> None:
        """Its turn ended: the pin runs `ttl_s` from now (a live pin is refreshed by every
        turn), and counts the bytes the conversation holds."""
        with self._lock:
            pin = self.pins.get(conversation_id)
            if pin is None:
                return
            pin.until = now + pin.ttl_s
            pin.bytes = size
            self.changes += 1

    def hold(self, conversation_id: str, until: float) -> None:
        """The server holds the conversation until then (a tool wait's hold)."""
        with self._lock:
            self.holds[conversation_id] = until
            self.changes += 1

    def hold_queued(self, conversation_id: str, now: float, hold_s: float) -> None:
        """Its next turn came while held: the hold runs `hold_s` again from now, so the turn
        does not lose its context while it waits to run (not longer: queued turns that each
        held room the first one needs would wait for each other forever)."""
        with self._lock:
            until = self.holds.get(conversation_id, 0.0)
            if until > now:
                self.holds[conversation_id] = max(until, now + hold_s)
                self.changes += 1

    def unhold(self, conversation_id: str) -> None:
        with self._lock:
            if self.holds.pop(conversation_id, None) is not None:
                self.changes += 1

    def finish(self, conversation_id: str) -> None:
        """ttl_s 0: the session is over, its pin goes and its chunks go first."""
        with self._lock:
            self._drop(conversation_id)
            self.done.add(conversation_id)
            self.changes += 1

    def prioritize(self, conversation_id: str, priority: int) -> None:
        """A priority without a pin."""
        with self._lock:
            self._set_priority(conversation_id, priority)
            self.done.discard(conversation_id)
            self.changes += 1

    def release(self, conversation_id: str) -> None:
        """Forget the conversation's pin and priority (it was deleted)."""
        with self._lock:
            self._drop(conversation_id)
            self.holds.pop(conversation_id, None)
            self.done.discard(conversation_id)
            self.changes += 1

    def restore(self, kept: list[Retained], now: float) -> int:
        """Put back what `record` read out before a restart: pins still in force (counted
        against their owners' caps from now on, never refused: they were accepted), the
        priorities, the finished sessions. Returns the pins put back."""
        pinned = 0
        with self._lock:
            for r in kept:
                cid = r.conversation_id
                if r.done:
                    self._drop(cid)
                    self.done.add(cid)
                    continue
                self._set_priority(cid, r.priority)
                self.done.discard(cid)
                if r.ttl_s is not None and r.until > now:
                    self.pins[cid] = Pin(r.owner, r.ttl_s, r.until, r.priority, r.bytes)
                    pinned += 1
            self.changes += 1
        return pinned

    # ---- inspection -------------------------------------------------------------------------

    def record(self, conversation_id: str, now: float) -> Retained | None:
        """What the pins hold of the conversation (None: nothing: no pin in force, a neutral
        priority, not done)."""
        with self._lock:
            pin = self.pins.get(conversation_id)
            priority = self.priority.get(conversation_id, NEUTRAL)
            done = conversation_id in self.done
        if pin is not None and pin.until > now:
            return Retained(
                conversation_id, pin.owner, pin.ttl_s, pin.until, pin.bytes, priority, done
            )
        if priority == NEUTRAL and not done:
            return None
        return Retained(conversation_id, priority=priority, done=done)

    def live(self, now: float) -> dict[str, Pin]:
        """The pins still in force; expired ones are forgotten (a priority stays)."""
        with self._lock:
            gone = [cid for cid, p in self.pins.items() if p.until <= now]
            for cid in gone:
                del self.pins[cid]
            return dict(self.pins)

    def owner_bytes(self, owner: str, now: float, but: str | None = None) -> int:
        """Bytes the owner's live pins may hold (`but` left out). Call with the lock held."""
        return sum(
            p.bytes
            for cid, p in self.pins.items()
            if p.owner == owner and p.until > now and cid != but
        )

    # ---- internals --------------------------------------------------------------------------

    def _set_priority(self, conversation_id: str, priority: int) -> None:
        if priority == NEUTRAL:
            self.priority.pop(conversation_id, None)
        else:
            self.priority[conversation_id] = priority

    def _drop(self, conversation_id: str) -> None:
        self.pins.pop(conversation_id, None)
        self.priority.pop(conversation_id, None)
