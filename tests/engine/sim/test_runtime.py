"""The simulated pool's overlap rules: what a step's copies add to its forward."""

from __future__ import annotations

import pytest

from engine.copies import CopyPlan
from engine.sim.clock import VirtualClock
from engine.sim.cost import Fitted
from engine.sim.devices import Copies, Device
from engine.sim.runtime import SimPool

BLOCK = 1000  # bytes a block
GPU = Copies(swap_in_bps=1000.0, swap_out_bps=500.0, swap_in_hidden=0.75, synchronous=False)


def pool(copies: Copies = GPU) -> tuple[SimPool, VirtualClock]:
    clock = VirtualClock()
    dev = Device("test", Fitted("test", (0.0,) * 7), copies, 1e9, ())
    return SimPool(dev, clock, BLOCK, cpu=16), clock


def blocks(n: int) -> list[tuple[int, int]]:
    return [(i, i) for i in range(n)]


def test_a_forward_alone_takes_its_time() -> None:
    p, clock = pool()
    p.begin_step(CopyPlan())
    p.run(0.25)
    assert clock() == pytest.approx(0.25)


def test_the_forward_waits_for_the_swap_outs_before_it() -> None:
    p, clock = pool()
    p.begin_step(CopyPlan(swap_out=blocks(2)))  # 2000 bytes at 500 B/s: 4 s
    p.run(1.0)
    assert clock() == pytest.approx(5.0)


def test_a_swap_in_hides_its_measured_share_behind_the_forward() -> None:
    p, clock = pool()
    p.begin_step(CopyPlan(swap_in=blocks(2)))  # 2 s of copy beside a 4 s forward
    p.run(4.0)
    assert clock() == pytest.approx(4.0 + 0.25 * 2.0)  # the unhidden quarter shows
    p, clock = pool()
    p.begin_step(CopyPlan(swap_in=blocks(8)))  # 8 s of copy: the forward cannot end before it
    p.run(1.0)
    assert clock() == pytest.approx(8.0)


def test_background_swap_outs_stay_off_the_step_but_delay_the_next_copies() -> None:
    p, clock = pool()
    p.begin_step(CopyPlan())
    p.run(1.0)
    p.end_step(CopyPlan(background=blocks(4)))  # 8 s on the copy stream, from t=1
    assert clock() == pytest.approx(1.0)  # the step ended with its forward
    p.begin_step(CopyPlan(swap_in=blocks(1)))  # queued behind them: done at 1 + 8 + 1
    p.run(0.5)
    assert clock() == pytest.approx(10.0)
    assert not p.swap_in_busy()
    p.begin_step(CopyPlan(swap_in=blocks(4)))
    p.run(0.0)  # a step whose forward is empty still waits on its own swap-in
    assert clock() == pytest.approx(14.0)


def test_on_a_cpu_every_copy_is_on_the_step() -> None:
    p, clock = pool(Copies(1000.0, 500.0, 0.0, synchronous=True))
    p.begin_step(CopyPlan(swap_in=blocks(1), swap_out=blocks(1)))
    p.run(0.5)
    assert clock() == pytest.approx(1.0 + 2.0 + 0.5)
    p.end_step(CopyPlan(background=blocks(1)))
    assert clock() == pytest.approx(5.5)
    assert p.copied_bytes == 3 * BLOCK


def test_the_forward_waits_for_the_last_steps_background_swap_outs() -> None:
    p, clock = pool()
    p.begin_step(CopyPlan())
    p.run(1.0)
    p.end_step(CopyPlan(background=blocks(2)))  # 4 s on the copy stream, from t=1
    p.begin_step(CopyPlan())  # no copies of its own: it still waits for those (t=5)
    p.run(1.0)
    assert clock() == pytest.approx(6.0)
    p.begin_step(CopyPlan())  # nothing in the background before it: no wait
    p.run(1.0)
    assert clock() == pytest.approx(7.0)


def test_the_hosts_work_comes_first_and_hides_the_copies_still_running() -> None:
    p, clock = pool()
    p.begin_step(CopyPlan())
    p.run(1.0, host_s=0.5)  # the host, then the forward
    assert clock() == pytest.approx(1.5)
    p.end_step(CopyPlan(background=blocks(1)))  # 2 s on the copy stream, done at 3.5
    p.begin_step(CopyPlan())
    p.run(1.0, host_s=3.0)  # the host's 3 s cover them: no wait
    assert clock() == pytest.approx(5.5)
    p.begin_step(CopyPlan(swap_out=blocks(1)))  # sent after the host's work: 0.5 + 2, then 1
    p.run(1.0, host_s=0.5)
    assert clock() == pytest.approx(5.5 + 0.5 + 2.0 + 1.0)
    cpu, clock = pool(Copies(1000.0, 500.0, 0.0, synchronous=True))
    cpu.begin_step(CopyPlan(swap_in=blocks(1)))
    cpu.run(0.5, host_s=0.25)  # on a CPU everything in a row
    assert clock() == pytest.approx(0.25 + 1.0 + 0.5)
