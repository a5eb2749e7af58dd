"""The replay in virtual time replays what the real driver does: the queue's limit and the
drain's deadline."""

from __future__ import annotations

import pytest

from bench.lib import workload as wl
from bench.lib.metrics import window_metrics
from bench.lib.virtual import replay
from engine import Engine, EngineConfig


def engine(**kw) -> Engine:
    cfg = dict(model="dummy:llama-2-13b-gqa10", device="sim:h100", gpu_cache_chunks=300,
               cpu_cache_chunks=0, cache_mode="gpu")  # fmt: skip
    return Engine(EngineConfig(**(cfg | kw)))


def plans(n: int, turns: int, output: int, arrival: float = 0.0) -> list[wl.Plan]:
    convs = [wl.Conversation(f"c{i}", [wl.TurnSpec([i + 1] * 50, output) for _ in range(turns)])
             for i in range(n)]  # fmt: skip
    return [wl.Plan(c, arrival, [0.1] * (turns - 1)) for c in convs]


def test_a_full_queue_refuses_a_turn_and_its_conversation_ends() -> None:
    # Six first turns at once, before any step: two queue, the other four are refused.
    records, _ = replay(engine(max_waiting=2), plans(6, 2, 8), "q", queue_limit=True)
    refused = [r for r in records if r.error]
    assert len(refused) == 4
    assert all(r.error.startswith("EngineOverloaded") for r in refused)
    assert all(r.output_tokens == 0 for r in refused)
    done = {r.conversation for r in records if not r.error}
    assert len(done) == 2 and len(records) == 4 + 2 * 2  # a refusal ends its conversation
    # With room in the queue, or without the limit (a preset's sweep), nothing is refused.
    records, _ = replay(engine(), plans(6, 2, 8), "q", queue_limit=True)
    assert len(records) == 12 and not any(r.error for r in records)
    records, _ = replay(engine(max_waiting=2), plans(6, 2, 8), "q")
    assert len(records) == 12 and not any(r.error for r in records)


def test_turns_still_running_at_the_deadline_are_cut_and_counted_at_their_lower_bound() -> None:
    e = engine()
    records, span = replay(e, plans(4, 3, 2000), "d", stop_s=1.0, deadline_s=2.0)
    assert not e.has_work() and span >= 2.0
    assert len(records) == 4  # cut in their first turn: no second is sent past the window
    for r in records:
        assert r.stats["censored"] == 1
        assert 0 < r.stats["completed_tokens"] < 2000
        assert r.done_s == pytest.approx(2.0) and r.output_tokens == 2000
    m = window_metrics(records, span)
    assert m["cancelled_at_drain"] == 4 and m["turns"] == 0
    assert m["norm_latency_mean"] == pytest.approx(2.0 / 2000)
    # Without a deadline every turn runs to its end.
    records, span = replay(engine(), plans(4, 3, 2000), "d", stop_s=1.0)
    assert span > 2.0 and all(
        r.output_tokens == 2000 and not r.stats.get("censored") for r in records
    )


def test_typing_hints_prefetch_in_virtual_time_too() -> None:
    """A plan's typing hints (`Plan.lead_s`) told to a simulated engine: idle contexts the
    small GPU tier swapped out come back before their turns; not told, none do."""

    def prefetched(typing: bool) -> int:
        e = engine(cache_mode="pensieve", gpu_cache_chunks=12, cpu_cache_chunks=300)
        ps = [wl.Plan(p.conversation, 0.5 * i, [20.0] * 2, lead_s=[10.0] * 2)
              for i, p in enumerate(plans(8, 3, 64))]  # fmt: skip
        records, _ = replay(e, ps, "t", typing=typing)
        assert len(records) == 24 and not any(r.error for r in records)
        return sum(r.stats.get("prefetched_tokens", 0) for r in records)

    assert prefetched(True) > 0 and prefetched(False) == 0
