"""Warm before ready: one tiny turn through the engine before the server says it is ready.

The first forward of a process pays one-time costs the later ones do not: the compiled CPU
forward's first shapes of a decode step, the native CPU attention kernel's build or load,
the sampler's first call. Run at start, they are paid before the first person's message.

The turn leaves no trace: its conversation (an id no chat has) is freed and erased, and
what a turn adds to the engine's tallies (its counters, the return chances it learns) is put
back as it was, so the admin page and the metrics show no warm-up. Pointless on a simulated
device (no forward runs)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from engine.engine import Engine
from engine.sim import is_simulated
from engine.snapshot import EngineCounters
from engine.types import EngineConfig, SamplingParams, Turn

# No chat's id (the app's are UUIDs, the API's `conv_` ones too)
WARM_ID = "pensieve-warm-up"
# Tokens generated: the first comes from the prompt's step, the rest from decode steps
WARM_TOKENS = 3


def needed(config: EngineConfig) -> bool:
    """Whether a warm-up does anything: every device but a simulated one."""
    return not is_simulated(config.device)


def warm_turn(prompt: list[int]) -> Turn:
    """The warm-up's turn: `prompt` (a few tokens, under one chunk: nothing to share or
    spill), then WARM_TOKENS generated whatever they are (no stop token ends it early)."""
    sampling = SamplingParams(max_tokens=WARM_TOKENS, min_tokens=WARM_TOKENS, temperature=0.0)
    return Turn(WARM_ID, list(prompt), sampling)


@dataclass(frozen=True)
class Tallies:
    """What a turn adds to an engine's learned totals, read before the warm-up."""

    counters: EngineCounters
    learned: tuple[float, float]  # the policy's return chances (`Policy.learned`)

    @classmethod
    def of(cls, engine: Engine) -> Tallies:
        return cls(replace(engine.counters), engine.cache.policy.learned())

    def put_back(self, engine: Engine) -> None:
        """On the loop thread, between steps: the tallies as they were. The counters are
        set in place (the cache and prefetch hold the same object)."""
        for f in fields(EngineCounters):
            setattr(engine.counters, f.name, getattr(self.counters, f.name))
        engine.cache.policy.unlearn(self.learned)
