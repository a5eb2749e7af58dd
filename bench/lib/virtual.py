"""The workload replayed against an engine on a simulated device, in its virtual time.

The real replay's conversations, arrivals and think times (`workload.script`) driven by
events: the engine steps while it has work, each step moving the clock by what the device
model says it took; idle, the clock jumps to the next event. A twin replays a real run as
its driver did: `queue_limit` refuses a turn at a full queue (as the AsyncEngine does), a
deadline cancels what still runs and counts it at its latency so far (`drivers.censored`).
The host time of the engine's own steps (scheduler and cache, run for real) is measured.
On a wall clock (which cannot jump) an idle engine sleeps to the next event instead.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.lib import workload as wl
from bench.lib.drivers import censored, turn_stats
from engine import EngineOverloaded, SamplingParams, Turn

STALLS = 1000  # futile waits for a history read (50 ms each) before a replay gives up


@dataclass
class HostTime:
    """Real seconds the engine's own steps took (the simulated forward costs nothing)."""

    steps: int = 0
    seconds: list[float] = field(default_factory=list)  # per step
    virtual_s: list[float] = field(default_factory=list)  # per step: its simulated time
    conversations: list[int] = field(default_factory=list)  # per step: tables in the cache

    def summary(self) -> dict[str, Any]:
        if not self.seconds:
            return {"steps": 0}
        host = sorted(self.seconds)
        share = sorted(h / v for h, v in zip(self.seconds, self.virtual_s, strict=True) if v > 0)
        return {
            "steps": len(host),
            "host_ms_mean": 1e3 * sum(host) / len(host),
            "host_ms_p50": 1e3 * wl.percentile(host, 50),
            "host_ms_p90": 1e3 * wl.percentile(host, 90),
            "step_ms_mean": 1e3 * sum(self.virtual_s) / len(self.virtual_s),
            "host_share_mean": sum(share) / len(share) if share else None,
            "host_share_p50": wl.percentile(share, 50) if share else None,
            "conversations_max": max(self.conversations),
        }


def replay(
    engine,
    plans: list[wl.Plan],
    tag: str,
    time_scale: float = 1.0,
    stop_s: float | None = None,
    host: HostTime | None = None,
    deadline_s: float | None = None,
    queue_limit: bool = False,
    cut_s: float | None = None,
    at_cut: Callable[[dict[int, str], list[tuple[float, str]], list], None] | None = None,
    typing: bool = False,
) -> tuple[list[wl.TurnRecord], float]:
    """Every plan replayed to its end: the turn records and the virtual seconds it took.
    `deadline_s` (past `stop_s`): what is in flight then is cancelled, counted as censored.
    `cut_s`: nothing more is sent from then, and `at_cut(turns in flight by id of request,
    pending events, records)` sees the replay there (`steady.warm_up`).
    `typing`: the engine is told the plans' typing hints (`Plan.lead_s`)."""
    clock = engine.now
    start = clock()
    due = [start]  # the time of the event being handled: a turn is sent at its own time
    records: list[wl.TurnRecord] = []
    events: list[tuple[float, int, Any]] = []  # (due, order, conversation's script)
    order = itertools.count()
    # id of the request in flight -> (its conversation's script, the request, its turn)
    waiting: dict[int, tuple[Any, Any, wl.TurnSpec, wl.Send]] = {}
    cut_at = None if deadline_s is None else start + deadline_s
    names: dict[int, str] = {}  # id of a conversation's script -> its id
    sending = [True]  # False past `cut_s`

    def advance(steps, reply: wl.Reply | None) -> None:
        try:
            step = steps.send(reply)
        except StopIteration:
            return
        if not sending[0]:
            return
        if isinstance(step, wl.Wait):
            heapq.heappush(events, (due[0] + max(0.0, step.seconds), next(order), steps))
            return
        if isinstance(step, wl.Typing):
            if typing:
                engine.prefetch(f"{tag}/{step.conversation}")
            advance(steps, None)
            return
        sampling = SamplingParams(max_tokens=step.spec.output_len, ignore_eos=True)
        turn = Turn(f"{tag}/{step.conversation}", list(step.spec.prompt), sampling)
        try:
            engine.accept(turn, engine.queued() if queue_limit else 0)
            req = engine.submit(turn, accepted=True)
        except (ValueError, EngineOverloaded) as e:  # refused: a result, not a crash
            now = due[0]
            advance(steps, wl.Reply(now, now, 0, error=f"{type(e).__name__}: {e}"))
            return
        waiting[id(req)] = (steps, req, step.spec, step)

    def cut() -> None:
        """The deadline passed: every turn in flight is cancelled, counted at its time."""
        assert cut_at is not None
        due[0] = cut_at
        for key, (steps, req, spec, _) in list(waiting.items()):
            del waiting[key]
            engine.cancel(req)
            first = req.stats.first_token_s if req.output else cut_at
            first = min(first, cut_at) - start  # a first token after the deadline: not seen
            advance(steps, censored(spec, first, cut_at - start, len(req.output)))

    def stop_sending() -> None:
        sending[0] = False
        if at_cut is not None:
            flying = {key: w[3].conversation for key, w in waiting.items()}
            at_cut(flying, [(at, names[id(steps)]) for at, _, steps in events], records)
        events.clear()

    stalls = 0  # steps in a row that ran nothing, with no event to wait for
    for p in plans:
        steps = wl.script(p, lambda: due[0] - start, time_scale, stop_s, records.append)
        names[id(steps)] = p.conversation.id
        advance(steps, None)
    while events or engine.has_work() or (cut_s is not None and sending[0]):
        while events and events[0][0] <= clock():
            due[0], _, steps = heapq.heappop(events)
            advance(steps, None)
        if cut_s is not None and sending[0] and clock() - start >= cut_s:
            stop_sending()
            continue
        if waiting and cut_at is not None and clock() > cut_at:
            cut()
        if not engine.has_work():
            if cut_s is not None and sending[0] and (not events or events[0][0] - start > cut_s):
                advance_to(clock, start + cut_s)
                stop_sending()
            elif events:
                advance_to(clock, events[0][0])
            continue
        before = clock()
        t = time.perf_counter()
        ended = engine.step()
        if host is not None:
            host.seconds.append(time.perf_counter() - t)
            host.virtual_s.append(clock() - before)
            host.conversations.append(len(engine.cache.held()))
        due[0] = clock()
        if cut_at is not None and clock() > cut_at:
            cut()  # the turns that ended in this step too: they were not done by then
            ended = []
        for req in ended:
            if id(req) not in waiting:  # cancelled at the deadline, recorded then
                continue
            s = req.stats
            error = None if req.finish_reason == "length" else str(req.finish_reason)
            reply = wl.Reply(
                s.first_token_s - start, s.finish_s - start, len(req.output), turn_stats(s), error
            )
            advance(waiting.pop(id(req))[0], reply)
        if clock() > before or ended:
            stalls = 0
            continue
        if wait_next(engine, clock, events):
            stalls += 1
            if stalls > STALLS:
                raise RuntimeError(f"{tag}: the engine made no progress in {stalls} tries")
    return records, clock() - start


def advance_to(clock, t: float) -> None:
    """Move a virtual clock on to `t`; a wall clock is slept on until then."""
    jump = getattr(clock, "advance_to", None)
    if jump is not None:
        jump(t)
    else:
        time.sleep(max(0.0, t - clock()))


def wait_next(engine, clock, events: list) -> bool:
    """Nothing could run: move the virtual clock to the next event, or the end of a read
    (the disk tier's); True where only a history read (a worker thread, real time) can
    unblock it and it was waited for."""
    wake = [t for t in (events[0][0] if events else None, engine.next_read_s()) if t is not None]
    if wake:
        advance_to(clock, min(wake))
        return False
    engine.wait_for_io()
    return True
