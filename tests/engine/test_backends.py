"""The backend is chosen once from the config, and gives the engine its parts."""

from __future__ import annotations

import pytest

from engine import Engine, EngineConfig
from engine.backends import Local, Simulation, pick
from engine.kv_pool import KVPool
from engine.sim.runtime import SimPool, SimRunner


def test_a_device_picks_its_backend() -> None:
    local = pick(EngineConfig(model="dummy:tiny", device="cpu"), Engine)
    assert type(local) is Local and local.model is not None and local.attention == "torch"
    sim = pick(EngineConfig(model="dummy:tiny", device="sim:h100"), Engine)
    assert type(sim) is Simulation and sim.model is None and sim.guides() is None
    assert sim.now() == 0.0  # virtual time
    local.close()
    sim.close()


@pytest.mark.parametrize("mode, cpu", [("pensieve", 8), ("gpu", 0), ("stateless", 0)])
def test_tiers_are_the_configs_and_only_pensieve_has_a_cpu_tier(mode: str, cpu: int) -> None:
    config = EngineConfig(model="dummy:tiny", device="sim:h100", cache_mode=mode,
                          gpu_cache_chunks=4, cpu_cache_chunks=8)  # fmt: skip
    config.validate()
    backend = pick(config, Engine)
    assert backend.tier_sizes() == (4, cpu)


def test_the_engine_is_built_from_its_backends_parts() -> None:
    real = Engine(EngineConfig(model="dummy:tiny", device="cpu", gpu_cache_chunks=8))
    sim = Engine(EngineConfig(model="dummy:tiny", device="sim:h100", gpu_cache_chunks=8))
    assert isinstance(real.pool, KVPool) and real.backend.gpu is False
    assert isinstance(sim.pool, SimPool) and isinstance(sim.runner, SimRunner)
    assert sim.backend.gpu is True and sim.now is sim.backend.now
    real.close()
    sim.close()
