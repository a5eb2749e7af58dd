"""Conversations: each one's token stream as the engine knows it, its turn in flight, and its
life (a turn accepted, queued, closed; a fork, a rewrite, a free), told to the cache's
policy as events. The step loop (`engine/steps.py`) runs the turns queued here."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from engine.cache.manager import KVCacheManager, chain_hashes
from engine.cache.retention import Retainer
from engine.disk.tier import DiskTier
from engine.drain import DEFAULT_S as DEFAULT_RETRY_S
from engine.errors import ConversationBusy, EngineOverloaded
from engine.guide import Matcher
from engine.kv_events import KVEvents
from engine.persistence import ActivityClock, TokenHistory
from engine.request import Request
from engine.sampler import make_generator
from engine.scheduler import Scheduler
from engine.snapshot import EngineCounters
from engine.stream import Claims, StreamState, extend_hashes, resync
from engine.types import EngineConfig, Turn, TurnStats


class Conversations:
    """The records (`streams`, written here only), the claims (one turn per conversation at
    a time, for every front), the history the engine keeps itself (`owns_history`), and
    what each conversation's life does to the cache, the scheduler and the disk tier. The
    engine holds its lock around every call but `claim` (the claims have their own)."""

    def __init__(
        self,
        config: EngineConfig,
        cache: KVCacheManager,
        scheduler: Scheduler,
        history: TokenHistory,
        owns_history: bool,
        clock: ActivityClock,
        counters: EngineCounters,
        now: Callable[[], float],
        device: torch.device,
        max_context: int,
        retainer: Retainer,
        disk: DiskTier | None = None,
    ) -> None:
        self.config, self.cache, self.scheduler = config, cache, scheduler
        self.history, self.owns_history = history, owns_history
        self.clock, self.counters, self.now = clock, counters, now
        self.device, self.max_context = device, max_context
        self.retainer, self.disk = retainer, disk
        self.policy = cache.policy
        self.streams: dict[str, StreamState] = {}
        self.claims = Claims()
        self.events: KVEvents | None = None  # told each conversation's tokens (KV events on)
        self.seq = itertools.count()  # the order turns and prefetches came in

    # ---- a turn in -----------------------------------------------------------------------------

    def claim(self, turn: Turn, queued: int, retry_s: Callable[[int], float] | None) -> None:
        """Claim the turn's conversation (ConversationBusy if a turn of it is in flight),
        apply the queue's limit (EngineOverloaded past `max_waiting`) and reserve its pin
        (PinRefused past its owner's cap); on a refusal nothing stays claimed."""
        cid = turn.conversation_id
        self.claims.claim(cid)
        limit = self.config.max_waiting
        if queued >= limit:
            self.claims.release(cid)
            wait = DEFAULT_RETRY_S if retry_s is None else retry_s(queued)
            raise EngineOverloaded(f"the engine has {limit} turns queued already", wait)
        try:
            r = turn.retention
            if r is not None and r.disk_s and self.disk is None:
                raise ValueError(
                    "prompt_cache_retention: this server has no disk tier (disk_cache_dir) to "
                    "keep a conversation's KV past memory"
                )
            state = self.streams.get(cid)
            length = state.length if state else 0
            self.retainer.reserve(turn, length if turn.context_len is None else turn.context_len)
        except BaseException:
            self.withdraw(cid)
            raise

    def withdraw(self, conversation_id: str) -> None:
        """A claimed turn does not run after all: its claim and what it asked go."""
        self.claims.release(conversation_id)
        self.policy.withdrawn(conversation_id)

    def open(
        self, turn: Turn, on_token: Callable[[int], None] | None, guide: Matcher | None
    ) -> Request:
        """Queue a claimed turn with the scheduler: its stream resynced to the caller's
        history, its shared prefix linked on a first turn, the policy told it came."""
        cache = self.cache
        state = self.streams.get(turn.conversation_id) or StreamState(turn.conversation_id)
        length = state.length if turn.context_len is None else turn.context_len
        total = length + len(turn.prompt_token_ids)
        if total >= self.max_context:
            raise ValueError(
                f"context of {total} tokens reaches the model's limit of {self.max_context}"
            )
        if cache.n_chunks(total + 1) > cache.gpu_capacity():
            raise ValueError(
                f"context of {total} tokens does not fit the KV cache "
                f"({cache.gpu_capacity()} chunks of {cache.chunk_size})"
            )
        self.streams[state.id] = state
        table = cache.table(state.id)
        # Its prefetch ends; a running one goes on if the context stays, to be taken over.
        prefetch = self.scheduler.supersede(state.id, keep=length == state.length)
        if length != state.length:
            resync(state, length, cache)
        now = self.now()
        new_job = self.policy.arrived(state.id, now, state.idle_since)
        if new_job or state.job_since is None:
            state.job_since = now  # a tool's result goes on with its job
        self.clock.touch(state.id, now)
        prompt = list(turn.prompt_token_ids)
        chain, shared = [], 0
        if state.length == 0:
            chain, shared = cache.link_prompt(table, prompt)
            state.kv_len = shared
        req = Request(
            turn=turn,
            state=state,
            table=table,
            seq=next(self.seq),
            base=state.kv_len,
            tokens=state.tail + prompt[shared:],
            stats=TurnStats(prompt_tokens=len(prompt), shared_tokens=shared, arrival_s=now),
            generator=make_generator(turn.sampling, self.device),
            on_token=on_token,
            chain=chain,
            guide=guide,
            rank=state.job_since if self.config.job_order else now,
        )
        if self.events is not None:  # its chunks are announced as their KV is computed
            self.events.extend(state.id, state.length, prompt)
        state.tail = []
        if self.owns_history:
            self.history.append(state.id, prompt)
        self.counters.prompt_tokens += len(prompt)
        self.scheduler.add(req, prefetch)
        return req

    def close(self, req: Request, now: float) -> None:
        """The turn ended: its stream goes on from its tokens, it is free again, its pin
        runs from now and a disk retention keeps its full chunks."""
        state = req.state
        state.length = req.total
        state.tail = req.tokens[state.kv_len - req.base :]
        self.claims.release(state.id)
        extend_hashes(state, req.base, req.tokens, req.prefix, self.cache.chunk_size)
        if self.events is not None:
            self.events.extend(state.id, req.base, req.tokens, req.prefix)
        req.guide = None  # its matcher is freed with it
        req.stats.finish_s = now
        if not req.output:
            req.stats.first_token_s = now
        self.clock.touch(state.id, now)
        state.idle_since = now
        self.policy.ended(state.id)
        self.retainer.settle(state.id, now)
        r = req.turn.retention
        if r is not None and r.disk_s and self.disk is not None:
            self.disk.keep(state, r.disk_s)
        if self.owns_history:
            self.history.append(state.id, req.output)

    # ---- between turns -------------------------------------------------------------------------

    def hint(self, conversation_id: str) -> None:
        """Its user is typing: the scheduler's prefetch (a no-op for unknown or busy
        conversations)."""
        state = self.streams.get(conversation_id)
        if state is None or conversation_id in self.claims:  # unknown, or its turn is here
            return
        now = self.now()
        if self.scheduler.hint(state, next(self.seq), now):
            self.clock.touch(conversation_id, now)  # its chunks are worth keeping now

    def tools_called(self, conversation_id: str, tools: list[str]) -> None:
        """Its last turn ended calling `tools` (a no-op for unknown or busy ones)."""
        state = self.streams.get(conversation_id)
        if state is None or conversation_id in self.claims:
            return
        since = state.idle_since if state.idle_since is not None else self.now()
        self.policy.called_tools(conversation_id, tools, since)

    def fork(
        self, parent_id: str, child_id: str, token_ids: list[int], parent_len: int | None
    ) -> int:
        """`Engine.fork`: the child's stream from the parent's full chunks linked."""
        if child_id in self.streams or self.cache.find(child_id) is not None:
            raise ValueError(f"conversation {child_id!r} exists already")
        parent = self.streams.get(parent_id)
        table = self.cache.find(parent_id)
        cs = self.cache.chunk_size
        if (
            parent is None
            or table is None
            or parent_id in self.claims
            or (parent_len is not None and parent.length != parent_len)
            or len(token_ids) > parent.length
        ):
            return 0
        chain = chain_hashes(list(token_ids), cs)
        linked = self.cache.fork(table, child_id, chain, parent.kv_len)
        if not linked:
            return 0
        full = len(token_ids) // cs * cs
        self.streams[child_id] = StreamState(
            child_id, length=len(token_ids), kv_len=linked, tail=list(token_ids[linked:]),
            hashes=chain[: full // cs], unhashed=list(token_ids[full:]),
        )  # fmt: skip
        if self.owns_history:
            self.history.append(child_id, list(token_ids))
        self.clock.touch(child_id, self.now())
        return linked

    def rewrite(self, conversation_id: str, keep: int, token_ids: list[int], length: int) -> bool:
        """`Engine.rewrite`: the stream's tokens after `keep` replaced, computed next turn."""
        state = self.streams.get(conversation_id)
        if (
            state is None
            or conversation_id in self.claims
            or state.length != length
            or not 0 <= keep <= length
        ):
            return False
        self.scheduler.supersede(conversation_id, keep=False)  # its context changes
        resync(state, keep, self.cache)  # the cut, as when a caller's history is shorter
        extend_hashes(state, keep, list(token_ids), None, self.cache.chunk_size)
        if self.events is not None:
            self.events.extend(conversation_id, keep, list(token_ids))
        state.tail += token_ids
        state.length += len(token_ids)
        if self.owns_history:
            self.history.truncate(conversation_id, keep)
            self.history.append(conversation_id, list(token_ids))
        self.counters.reencoded_tokens += len(token_ids)
        return True

    def free(self, conversation_id: str, erase: bool) -> None:
        """`Engine.free`: forget its cache (and with `erase` its disk chunks and pin)."""
        state = self.streams.get(conversation_id)
        if conversation_id in self.claims:
            raise ConversationBusy(f"conversation {conversation_id!r} has a turn in flight")
        if erase and state is not None and self.disk is not None:
            self.disk.erase(state.hashes)
        self.scheduler.supersede(conversation_id, keep=False)
        self.streams.pop(conversation_id, None)
        self.cache.forget(conversation_id)
        self.policy.forgotten(conversation_id, erase)
        if self.owns_history:
            self.history.forget(conversation_id)
