"""What an engine runs on, chosen once from its config: one process, tensor-parallel ranks,
or a simulated device (`base.Backend` is the interface the engine is built over)."""

from __future__ import annotations

from collections.abc import Callable

from engine.backends.base import Backend
from engine.backends.local import Local
from engine.backends.parallel import Parallel
from engine.backends.simulated import Simulation
from engine.calibrate import Build
from engine.sim import is_simulated
from engine.types import EngineConfig

__all__ = ["Backend", "Local", "Parallel", "Simulation", "pick"]


def pick(config: EngineConfig, build: Build, now: Callable[[], float] | None = None) -> Backend:
    """The backend `config` asks for. `build`: the engine class (a simulated CPU calibrates
    itself with real engines). `now`: the clock of a real device (a simulation has its own)."""
    if is_simulated(config.device):
        return Simulation(config, build)
    if config.tensor_parallel > 1 or config.force_tensor_parallel:
        backend: Backend = Parallel(config)
    else:
        backend = Local(config)
    if now is not None:
        backend.now = now
    return backend
