"""A step as a value: the pieces of its batch, its copies, the turns it ends and the history
reads it asks for (`StepPlan`, what `Scheduler.schedule` returns); and whether a waiting
turn's history is here for its admission (`history`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from engine.cache.manager import KVCacheManager
from engine.copies import CopyPlan
from engine.request import Request


class Fetch(StrEnum):
    """Whether a waiting turn's history is here for its admission (`Scheduler._history`)."""

    READY = "ready"
    PENDING = "pending"
    FAILED = "failed"


@dataclass(slots=True)  # dozens a step
class Piece:
    """One sub-request of a step: positions [start, end) of a turn's conversation."""

    req: Request
    start: int
    end: int
    sample: bool  # its last position is the last known token: sample the next one


@dataclass(frozen=True)
class Read:
    """A history read the engine must start: `req`'s tokens before it, and with a disk tier
    the chunks it has of the table's dropped run of `dropped` chunks."""

    req: Request
    dropped: int


@dataclass(frozen=True)
class StepPlan:
    pieces: list[Piece] = field(default_factory=list)
    before: CopyPlan = field(default_factory=CopyPlan)  # swap-outs, swap-ins: with the forward
    after: CopyPlan = field(default_factory=CopyPlan)  # ahead-of-time copies: after it
    full: list[Request] = field(default_factory=list)  # filled the whole GPU tier: end LENGTH
    failed: list[Request] = field(default_factory=list)  # history read failed: end ERROR
    reads: list[Read] = field(default_factory=list)  # history to read for waiting turns


def history(req: Request, cache: KVCacheManager, plan: StepPlan) -> Fetch:
    """READY once `req.prefix` holds the history its dropped positions need (and, with a
    disk tier, `req.loaded` what the tier has of the dropped run as it is now); PENDING
    while it is read, or after asking the engine to read it (`plan.reads`); FAILED if
    the read failed or found the history short (`req.error` says why)."""
    if req.fetch is not None:
        return Fetch.PENDING
    if req.error is not None:
        return Fetch.FAILED
    n = req.prefix_needed(cache.recompute_tokens(req.table, req.state.kv_len))
    dropped = cache.loadable(req.table)
    fresh = not dropped or req.read_for == dropped  # more dropped since: read again
    if req.prefix is not None and len(req.prefix) >= n and fresh:
        return Fetch.READY
    if req.prefix is not None and req.read_for == dropped:  # read for this state already
        req.error = LookupError(
            f"history of {req.state.id!r} has {len(req.prefix)} tokens, {n} are needed"
        )
        return Fetch.FAILED
    plan.reads.append(Read(req, dropped))
    return Fetch.PENDING
