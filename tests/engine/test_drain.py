"""Retry-After from the queue's measured drain rate."""

from __future__ import annotations

import pytest

from engine.drain import DEFAULT_S, MAX_S, MIN_S, DrainRate


def test_without_a_rate_the_wait_is_the_default() -> None:
    d = DrainRate()
    assert d.wait_s(100, 0.0) == DEFAULT_S
    d.ended(1.0)
    assert d.per_s(2.0) is None and d.wait_s(100, 2.0) == DEFAULT_S


def test_the_wait_is_the_queue_over_the_rate_within_bounds() -> None:
    d = DrainRate()
    for i in range(11):  # 10 turns a second
        d.ended(i * 0.1)
    assert d.per_s(1.0) == pytest.approx(10.0)
    assert d.wait_s(99, 1.0) == pytest.approx(10.0)  # 100 turns ahead at 10/s
    assert d.wait_s(3, 1.0) == MIN_S  # 0.4 s: no sooner than a second
    assert d.wait_s(10_000, 1.0) == MAX_S


def test_a_stalled_queue_slows_the_rate_down() -> None:
    d = DrainRate()
    for i in range(11):
        d.ended(i * 0.1)
    assert d.per_s(11.0) == pytest.approx(10 / 11.0)  # nothing ended for 10 s
    assert d.wait_s(9, 11.0) == pytest.approx(11.0)


def test_the_window_forgets_old_turns() -> None:
    d = DrainRate(window=4)
    for t in (0.0, 100.0, 100.5, 101.0, 101.5):  # the first is out of the window
        d.ended(t)
    assert d.per_s(101.5) == pytest.approx(2.0)
