"""One Dynamo request: the prompt's conversation found (prefixes.py), a Turn of its new
tokens submitted, the reply streamed back as Dynamo's frontend expects it (docs/dynamo.md).

- The prompt extends a conversation's whole stream: a turn of the new tokens goes on from it
  (its KV is where the router sent the request, as the worker's KV events said).
- It shares only part of one, or that one is busy (a regenerated or edited turn, a branch):
  a new conversation forked from it, linking the shared full chunks.
- Otherwise: a new conversation of the whole prompt."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from app.dynamo_worker.prefixes import Streams
from engine.async_engine import AsyncEngine, TurnStream
from engine.types import SamplingParams, Turn, TurnResult

log = logging.getLogger("pensieve.dynamo")


@dataclass
class Counters:
    """What this worker did, for tests and logs."""

    turns: int = 0
    extended: int = 0  # turns that went on from a conversation's whole stream
    forked: int = 0
    new: int = 0
    cached_tokens: int = 0


def sampling(request: dict[str, Any], default_max_tokens: int) -> SamplingParams:
    so = request.get("sampling_options") or {}
    sc = request.get("stop_conditions") or {}
    extra = (sc.get("stop_token_ids") or []) + (sc.get("stop_token_ids_visible") or [])
    return SamplingParams(
        max_tokens=sc.get("max_tokens") or default_max_tokens,
        temperature=1.0 if so.get("temperature") is None else so["temperature"],
        top_p=1.0 if so.get("top_p") is None else so["top_p"],
        top_k=max(0, so.get("top_k") or 0),  # vLLM's -1 is off, as Pensieve's 0
        seed=so.get("seed"),
        ignore_eos=bool(sc.get("ignore_eos")),
        stop_token_ids=tuple(extra),
        min_tokens=sc.get("min_tokens") or 0,
    )


def usage(prompt_len: int, result: TurnResult) -> dict[str, Any]:
    s = result.stats
    completion = len(result.token_ids)
    return {
        "prompt_tokens": prompt_len,
        "completion_tokens": completion,
        "total_tokens": prompt_len + completion,
        # as `pensieve serve` counts it: the context found in memory or on disk
        "prompt_tokens_details": {
            "cached_tokens": s.cached_tokens + s.swapped_in_tokens + s.disk_tokens
        },
    }


class Handler:
    def __init__(self, engine: AsyncEngine, default_max_tokens: int = 512) -> None:
        self.engine = engine
        self.chunk_size = engine.config.chunk_size
        self.streams = Streams(self.chunk_size)
        self.default_max_tokens = default_max_tokens
        self.counters = Counters()

    async def plan(self, prompt: list[int], sp: SamplingParams) -> Turn:
        """The turn that serves `prompt`: on the conversation that holds most of it."""
        m = self.streams.match(prompt)
        whole = m is not None and m.common == m.length < len(prompt)
        if whole and not self.engine.is_busy(m.conversation_id):
            self.counters.extended += 1
            return Turn(m.conversation_id, prompt[m.common :], sp, context_len=m.common)
        cid = uuid.uuid4().hex
        if m is not None and m.common >= self.chunk_size:
            keep = min(m.common, len(prompt) - 1)  # a turn needs a new token
            linked = await self.engine.fork(m.conversation_id, cid, prompt[:keep], m.length)
            if linked:
                self.counters.forked += 1
                return Turn(cid, prompt[keep:], sp, context_len=keep)
        self.counters.new += 1
        return Turn(cid, prompt, sp, context_len=0)

    async def generate(self, request: dict[str, Any], context: Any = None) -> AsyncIterator[dict]:
        prompt = list(request["token_ids"])
        turn = await self.plan(prompt, sampling(request, self.default_max_tokens))
        stream: TurnStream = self.engine.submit(turn)
        last: list[int] = []  # held back: the final chunk carries the last token
        try:
            async for token in stream:
                if last:
                    yield {"token_ids": last, "index": 0}
                last = [token]
        finally:
            if not stream.done:  # the client went: Dynamo closed this generator
                stream.cancel()
            if stream.result is None:  # gone or failed: the stream is not what was indexed
                self.streams.forget(turn.conversation_id)
        result = stream.result
        if result.finish_reason in ("stop", "length"):
            self.streams.put(turn.conversation_id, prompt + result.token_ids)
        else:  # cancelled: its stream is not what the next prompt renders
            self.streams.forget(turn.conversation_id)
        self.count(turn, result)
        # with the last token, else the frontend ends the reply at a stop token itself and
        # never reads the usage after it
        yield {
            "token_ids": last,
            "index": 0,
            "finish_reason": result.finish_reason,
            "completion_usage": usage(len(prompt), result),
        }

    def count(self, turn: Turn, result: TurnResult) -> None:
        s = result.stats
        self.counters.turns += 1
        self.counters.cached_tokens += s.cached_tokens + s.swapped_in_tokens + s.disk_tokens
        log.info(
            "turn %s: context %d, prompt %d, cached %d, reply %d (%s)",
            turn.conversation_id[:8],
            turn.context_len or 0,
            len(turn.prompt_token_ids),
            s.cached_tokens,
            len(result.token_ids),
            result.finish_reason,
        )
