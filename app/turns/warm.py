"""Warm before ready: the turn pipeline's one-time work done at start, before the server
says it is ready, so that a person's first message is as fast as the next.

A first turn pays for the chat template's first render (Jinja compiles it), the tokenizer's
first encode and decode, and the engine's first forward (`AsyncEngine.warm_up`,
engine/warm.py: the compiled CPU forward's decode shapes, the native CPU attention kernel).
Here they run once on a tiny chat that is never stored, and leave no trace in the engine."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from app.turns.detok import Detokenizer
from app.turns.window import plan_turn

if TYPE_CHECKING:  # the engine loads torch
    from engine import AsyncEngine

log = logging.getLogger("pensieve")

PROMPT_TOKENS = 8  # of the rendered chat, handed to the engine: under one chunk


async def warm_up(engine: AsyncEngine) -> float | None:
    """Run the pipeline's one-time work; the seconds it took, or None where there is none
    to do (a simulated device)."""
    t0 = time.perf_counter()
    plan = await asyncio.to_thread(
        plan_turn, engine.tokenizer, None, [], "Hello!", engine.context_limit, 4, True
    )
    tokens = await engine.warm_up(plan.prompt[:PROMPT_TOKENS])
    if tokens is None:
        return None
    detok = Detokenizer(engine.tokenizer, set(engine.stop_token_ids))
    for token_id in tokens:
        detok.push(token_id)
    detok.flush()
    took = time.perf_counter() - t0
    log.info("warmed up in %.1f s: the first message pays no one-time costs", took)
    return took
