"""The serving base of the OpenAI endpoints (Chat Completions, Responses): a turn run for
an API request and its sink, the outcome it waits for first, the turn and chat quotas, usage,
and removing a conversation made for one response."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from dataclasses import dataclass, replace

from starlette.requests import Request
from starlette.responses import Response

from app.cluster import handoff
from app.openai.errors import ApiError, pipeline_error
from app.openai.tools import CallStream
from app.services import Services
from app.turns.pipeline import DB_ERRORS, Done, Streamed
from app.turns.stops import StopMatcher

TITLE_CHARS = 80  # a new chat's title: the start of its first message


@dataclass
class Failed:
    """A turn's refusal or failure: the pipeline's error code, its message, a retry hint."""

    code: str
    message: str
    retry_after_s: float | None = None


END = object()  # the turn's task ended


class ApiSink:
    """Collects a turn's text (cut at a stop string), its outcome or its error."""

    def __init__(self, stops: list[str], calls: bool = False) -> None:
        self.open = True
        self.cancelled = False
        self.stream = None
        self.events: asyncio.Queue = asyncio.Queue()
        self.stops = StopMatcher(stops)
        self.calls = CallStream() if calls else None  # tools offered: calls come out whole

    async def error(self, code: str, message: str, **extra) -> None:
        self.events.put_nowait(Failed(code, message, extra.get("retry_after_s")))

    async def token(self, text: str) -> None:
        self._put(self.stops.push(text))
        if self.stops.hit and self.stream is not None:
            self.stream.cancel()

    def _put(self, piece: str) -> None:
        if not piece:
            return
        for event in self.calls.push(piece) if self.calls else [piece]:
            self.events.put_nowait(event)

    async def finish(self, out: Streamed) -> Streamed:
        if not self.stops.hit:
            self._put(self.stops.flush())
        for event in self.calls.flush() if self.calls else []:
            self.events.put_nowait(event)
        if self.stops.hit:
            return replace(out, text=self.stops.text, finish_reason="stop")
        return out

    async def done(self, done: Done) -> None:
        self.events.put_nowait(done)

    def gone(self) -> None:
        """The client left: the turn stops within a step and keeps what it generated."""
        self.open = False
        if self.stream is not None:
            self.stream.cancel()


def usage(done: Done) -> dict:
    s, plan = done.out.stats, done.plan
    prompt = plan.context_len + len(plan.prompt)
    completion = len(done.out.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {
            "cached_tokens": s.cached_tokens + s.swapped_in_tokens + s.disk_tokens,
            "disk_tokens": s.disk_tokens,  # of those, read back from the disk tier
        },
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


async def start(sv: Services, turn: Coroutine, sink: ApiSink) -> tuple[asyncio.Task, object]:
    """Run the turn as a task of the hub's (it outlives a client that leaves) and wait for
    its first event: text, a call, its outcome, or END."""
    task = sv.hub.track(turn)
    task.add_done_callback(lambda _: sink.events.put_nowait(END))
    return task, await sink.events.get()


def refusal(first) -> Response | None:
    """The answer to a turn whose first event is not a reply (None: it is one)."""
    if isinstance(first, Failed):
        return pipeline_error(first.code, first.message, first.retry_after_s).response()
    if first is END:
        return ApiError(500, "the turn ended without a reply", "server_error").response()
    return None


async def take_turn(request: Request, sv: Services, owner_id: str) -> None:
    """Count the turn against its owner's quota (ApiError 429 when spent); a request another
    replica handed over was counted there."""
    st = sv.settings
    if handoff.forwarded(request):
        return
    wait = await sv.quotas.take("turns", owner_id, st.turns_per_minute)
    if wait is not None:
        raise ApiError(429, f"at most {st.turns_per_minute} messages a minute",
                       "rate_limit_error", code="rate_limit_exceeded", retry_after_s=wait)  # fmt: skip


async def check_quota(sv: Services, owner_id: str) -> None:
    """ApiError 429 when the owner keeps as many chats as allowed already."""
    quota = sv.settings.max_chats_per_owner
    if await sv.store.count_conversations(owner_id) >= quota:
        raise ApiError(429, f"an owner may keep at most {quota} chats; delete one first",
                       "insufficient_quota", code="insufficient_quota")  # fmt: skip


async def drop(sv: Services, cid: str) -> None:
    """Remove a conversation made for one response, and its cache."""
    with contextlib.suppress(*DB_ERRORS):
        await sv.store.delete_conversation(cid)
    with contextlib.suppress(Exception):
        await sv.engine.free(cid, erase=True)
    forget = getattr(sv.clock, "forget", None)
    if forget:
        forget(cid)
