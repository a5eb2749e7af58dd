"""The engine in virtual time: `EngineConfig(device="sim:h100")` runs the real scheduler,
cache and policy, with the forward and the copies replaced by a device's cost model."""

from __future__ import annotations

from engine.sim.clock import VirtualClock

__all__ = ["PREFIX", "VirtualClock", "is_simulated"]

PREFIX = "sim:"


def is_simulated(device: str | None) -> bool:
    return device is not None and device.startswith(PREFIX)
