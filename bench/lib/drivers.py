"""How a benchmark sends a turn: to an in-process AsyncEngine, to a running server over
its WebSocket, or through its OpenAI API. Each returns a `workload.Reply` per turn."""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

from bench.lib import workload as wl
from engine import SamplingParams, Turn

# Per-turn token counts a reply reports, in process and over the WebSocket alike.
_USAGE = (
    "prompt_tokens",
    "cached_tokens",
    "swapped_in_tokens",
    "recomputed_tokens",
    "prefetched_tokens",
    "disk_tokens",
)


class EngineDriver:
    """Sends turns to an in-process AsyncEngine; each turn replays the reference reply length.

    A turn still running at `deadline` (time.monotonic()) is cancelled and recorded as
    censored: its latency so far over its planned length, a lower bound on its latency."""

    def __init__(
        self, engine, tag: str, temperature: float = 0.0, deadline: float = math.inf
    ) -> None:
        self.engine = engine
        self.tag = tag  # keeps ids of successive runs on one engine apart
        self.temperature = temperature  # 1.0: sampled, as OpenAI clients ask by default
        self.deadline = deadline
        self.ids: set[str] = set()

    async def send(self, cid: str, index: int, spec: wl.TurnSpec, context: int) -> wl.Reply:
        conv = f"{self.tag}/{cid}"
        self.ids.add(conv)
        sampling = SamplingParams(
            max_tokens=spec.output_len, temperature=self.temperature, ignore_eos=True
        )
        left = None if self.deadline == math.inf else max(0.0, self.deadline - time.monotonic())
        first, n = None, 0
        try:
            stream = self.engine.submit(Turn(conv, list(spec.prompt), sampling))
            try:
                async with asyncio.timeout(left):
                    async for _ in stream:
                        first = first or time.monotonic()
                        n += 1
            except TimeoutError:
                stream.cancel()
                now = time.monotonic()
                async for _ in stream:  # it ends within a step
                    pass
                return censored(spec, first or now, now, n)
            done = time.monotonic()
            res = stream.result
        except Exception as e:  # a refused turn is a result of the run, not a crash
            now = time.monotonic()
            return wl.Reply(now, now, 0, error=f"{type(e).__name__}: {e}")
        return wl.Reply(
            first_token_at=first or done,
            done_at=done,
            output_tokens=len(res.token_ids),
            stats=turn_stats(res.stats),
            error=None if res.finish_reason != "cancelled" else "cancelled",
        )

    def typing(self, cid: str) -> None:
        """The user started typing the conversation's next turn (the chat page's `typing`)."""
        self.engine.prefetch(f"{self.tag}/{cid}")

    async def free(self) -> None:
        for conv in self.ids:
            await self.engine.free(conv)
        self.ids.clear()


def censored(spec: wl.TurnSpec, first: float, now: float, tokens: int) -> wl.Reply:
    """A turn cancelled at a run's deadline after `tokens` of its reply: counted with its
    latency so far over its planned length, a lower bound (`metrics.window_metrics`)."""
    return wl.Reply(first, now, spec.output_len, {"censored": 1, "completed_tokens": tokens})


def turn_stats(stats) -> dict[str, Any]:
    out = {k: getattr(stats, k, 0) for k in _USAGE}
    out["suspensions"] = getattr(stats, "suspensions", 0)
    if getattr(stats, "admitted_s", 0) and getattr(stats, "arrival_s", 0):
        out["queued_s"] = stats.admitted_s - stats.arrival_s  # waiting to be scheduled
    return out


class UrlDriver:
    """Sends turns to a running server: REST to create chats, one WebSocket per chat.

    The server takes text, so each turn sends the user's message and asks for the reference
    reply's length as max_tokens; the reply may end earlier on a stop token.
    """

    def __init__(self, url: str, token: str, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.chats: dict[str, str] = {}
        self.sockets: dict[str, Any] = {}

    def _create(self) -> str:
        import urllib.request

        req = urllib.request.Request(
            f"{self.url}/api/conversations",
            data=json.dumps({"title": "bench"}).encode(),
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())["id"]

    async def _socket(self, cid: str):
        if cid not in self.sockets:
            from websockets.asyncio.client import connect

            self.chats[cid] = await asyncio.to_thread(self._create)
            ws_url = self.url.replace("http", "ws", 1) + f"/ws/chat/{self.chats[cid]}"
            self.sockets[cid] = await connect(
                ws_url, additional_headers={"Authorization": f"Bearer {self.token}"}
            )
        return self.sockets[cid]

    async def send(self, cid: str, index: int, spec: wl.TurnSpec, context: int) -> wl.Reply:
        try:
            ws = await self._socket(cid)
            msg = {"type": "message", "content": spec.text, "max_tokens": spec.output_len}
            await ws.send(json.dumps({**msg, "temperature": 0.0}))
            first = None
            while True:
                frame = json.loads(await asyncio.wait_for(ws.recv(), self.timeout))
                if frame["type"] == "token" and first is None:
                    first = time.monotonic()
                elif frame["type"] == "error":
                    now = time.monotonic()
                    return wl.Reply(now, now, 0, error=f"{frame['code']}: {frame['message']}")
                elif frame["type"] == "done":
                    done = time.monotonic()
                    usage = frame.get("usage", {})
                    stats = {k: usage.get(k, 0) for k in _USAGE}
                    return wl.Reply(
                        first or done, done, int(usage.get("completion_tokens", 0)), stats
                    )
        except Exception as e:
            now = time.monotonic()
            return wl.Reply(now, now, 0, error=f"{type(e).__name__}: {e}")

    async def close(self) -> None:
        for ws in self.sockets.values():
            await ws.close()
        self.sockets.clear()


class OpenAIDriver:
    """Sends turns to a running server's OpenAI API (/v1/chat/completions, streamed): each
    turn resends the whole chat, as OpenAI clients do, and the server finds the conversation
    it continues. Usage over /v1 has no tiers: `cached_tokens` is the context reused from
    either one, `prompt_tokens` the whole context."""

    def __init__(
        self,
        url: str,
        token: str | None,
        timeout: float = 600.0,
        extra: dict[str, Any] | None = None,
        session: str | None = None,
        keepalive: bool = True,
        fixed: bool = False,
    ) -> None:
        import httpx

        self.url = url.rstrip("/")
        # keepalive=False: a connection per request, never one the server is closing (as
        # llama-server closes idle ones)
        idle = None if keepalive else 0
        self.http = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {token}"} if token else {},
            timeout=timeout,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=idle),
            trust_env=False,
        )
        self.extra = extra or {}  # more body fields
        self.fixed = fixed  # every reply exactly max_tokens, no stop token in it (fixed_length)
        self.session = session  # set: each chat's prompt_cache_key is "<session>/<cid>"
        self.model: str | None = None
        self.chats: dict[str, list[dict]] = {}

    async def send(self, cid: str, index: int, spec: wl.TurnSpec, context: int) -> wl.Reply:
        try:
            if self.model is None:
                r = await self.http.get(f"{self.url}/v1/models")
                r.raise_for_status()
                self.model = r.json()["data"][0]["id"]
            messages = self.chats.setdefault(cid, [])
            messages.append({"role": "user", "content": spec.text})
            key = f"{self.session}/{cid}" if self.session else None
            extra = {**self.extra, **fixed_length(spec.output_len)} if self.fixed else self.extra
            body = request_body(self.model, messages, spec.output_len, key, extra)
            first, pieces, usage = None, [], {}
            async with self.http.stream("POST", f"{self.url}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    now = time.monotonic()
                    text = (await r.aread()).decode(errors="replace")[:200]
                    messages.pop()
                    return wl.Reply(now, now, 0, error=f"HTTP {r.status_code}: {text}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(chunk["error"]["message"])
                    for choice in chunk.get("choices", []):
                        piece = choice["delta"].get("content")
                        if piece:
                            first = first or time.monotonic()
                            pieces.append(piece)
                    usage = chunk.get("usage") or usage
            done = time.monotonic()
            messages.append({"role": "assistant", "content": "".join(pieces)})
            stats = {
                "prompt_tokens": usage.get("prompt_tokens", 0),
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            }
            return wl.Reply(first or done, done, int(usage.get("completion_tokens", 0)), stats)
        except Exception as e:
            now = time.monotonic()
            return wl.Reply(now, now, 0, error=f"{type(e).__name__}: {e}")

    async def close(self) -> None:
        await self.http.aclose()


def fixed_length(max_tokens: int) -> dict[str, Any]:
    """Body fields for a reply of exactly `max_tokens` in which no stop token is ever sampled,
    on servers that read `ignore_eos` either way: vLLM's (and the engine's) only keeps going
    past a stop token, llama.cpp's bans them. `min_tokens` (vLLM's extension) bans them below
    it on the first kind, so both generate the same kind of reply: plain text that renders
    back into the next turn's prompt as generated (a sampled `<|im_end|>` would not)."""
    return {"ignore_eos": True, "min_tokens": max_tokens}


def request_body(
    model: str,
    messages: list[dict],
    max_tokens: int,
    session: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A streamed, greedy /v1/chat/completions request that asks for its usage at the end;
    `session` is its prompt_cache_key (the conversation it continues), `extra` more fields."""
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if session is not None:
        body["prompt_cache_key"] = session
    return {**body, **(extra or {})}
