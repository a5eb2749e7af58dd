"""The engine: turns in, tokens out; each conversation's KV kept across turns."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from engine.cache import KVCacheManager
from engine.conversation import Conversation
from engine.history import ActivityClock, LocalClock, MemoryHistory, TokenHistory
from engine.kv_pool import KVPool
from engine.loader import cache_root, load
from engine.packed import pack_linears
from engine.policy import CostModel, Policy
from engine.profile import load_or_profile
from engine.request import FINISHED, RUNNING, Request
from engine.runner import Runner
from engine.sampler import make_generator
from engine.scheduler import Scheduler
from engine.types import EngineConfig, Turn, TurnResult, TurnStats
from kernels import pick_backend

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ConversationBusy(RuntimeError):
    """A turn of this conversation is already queued or running."""


def _pool_sizes(
    config: EngineConfig, bytes_per_block: int, device: torch.device
) -> tuple[int, int]:
    gpu, cpu = config.gpu_cache_chunks, config.cpu_cache_chunks
    if gpu is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            gpu = int(free * 0.85 - (2 << 30)) // bytes_per_block  # leave room for activations
        else:
            gpu = max(64, (1 << 30) // bytes_per_block)  # 1 GiB of "device" pool on the CPU
    if cpu is None:
        try:
            import os

            host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError):
            host = 8 << 30
        cpu = min(int(host * 0.4) // bytes_per_block, 4 * gpu)
    if config.cache_mode != "pensieve":
        cpu = 0
    if gpu < 2:
        raise ValueError(f"the KV pool holds only {gpu} blocks: not enough memory")
    return gpu, cpu


class Engine:
    """Synchronous core. `run` serves a batch of turns; `submit` + `step` drive it finely."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        history: TokenHistory | None = None,
        clock: ActivityClock | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        config.validate()
        self.device = torch.device(
            config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        )
        if config.dtype is None:
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        elif config.dtype in _DTYPES:
            self.dtype = _DTYPES[config.dtype]
        else:
            raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {config.dtype!r}")
        loaded = load(config.model, self.device, self.dtype, config.cache_dir, config.seed)
        self.model, self.args = loaded.model, loaded.args
        self.tokenizer = loaded.tokenizer
        self.stop_token_ids = loaded.stop_token_ids
        self.max_context = loaded.args.max_position
        if config.pack_cpu_weights:
            pack_linears(self.model)  # float32 CPU layers only; a no-op elsewhere
        self.backend = pick_backend(self.device, config.attention_backend)

        cs = config.chunk_size
        gpu, cpu = _pool_sizes(
            config, KVPool.bytes_per_block(self.args, cs, self.dtype), self.device
        )
        self.pool = KVPool(self.args, gpu, cpu, cs, self.device, self.dtype)
        cpu = self.pool.cpu_blocks  # may be less than asked: pinned memory is limited
        self.owns_history = history is None
        self.history = MemoryHistory() if history is None else history
        self.clock = LocalClock() if clock is None else clock
        if config.eviction == "pensieve" and config.cache_mode != "stateless":
            cost = load_or_profile(
                self.model,
                config.model,
                cs,
                self.max_context,
                self.device,
                self.dtype,
                cache_root(config.cache_dir),
                self.backend,
            )
        else:
            cost = CostModel.linear(cs, self.max_context)
        self.cache = KVCacheManager(
            gpu,
            cpu,
            cs,
            Policy(config.eviction, cost, cs, self.clock),
            config.cache_mode,
            config.admit_reserve,
            config.swap_out_threshold,
        )
        self.scheduler = Scheduler(
            self.cache, config.max_batch_tokens, config.max_running, config.unified, self._fetch
        )
        self.runner = Runner(self.model, self.pool, cs, self.backend)
        self._seq = itertools.count()
        self._reader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="history")
        self.lock = threading.RLock()  # guards all state below; held for a whole step
        self.counters = {"prompt_tokens": 0, "generated_tokens": 0, "steps": 0}

    # ---- turns in ----------------------------------------------------------------------------

    def validate(self, turn: Turn) -> None:
        """Errors that need no engine state."""
        if not isinstance(turn.conversation_id, str) or not turn.conversation_id:
            raise ValueError("conversation_id must be a non-empty string")
        if not turn.prompt_token_ids:
            raise ValueError("the prompt is empty: a turn needs at least one new token")
        vocab = self.args.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in turn.prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        turn.sampling.validate()
        if turn.context_len is not None and (
            not isinstance(turn.context_len, int) or turn.context_len < 0
        ):
            raise ValueError("context_len must be a non-negative integer")

    def submit(self, turn: Turn, on_token: Callable[[int], None] | None = None) -> Request:
        self.validate(turn)
        with self.lock:
            conv = self.cache.get(turn.conversation_id)
            if conv.busy:
                raise ConversationBusy(
                    f"conversation {turn.conversation_id!r} already has a turn in flight"
                )
            if turn.context_len is not None and turn.context_len != conv.length:
                self._resync(conv, turn.context_len)
            total = conv.length + len(turn.prompt_token_ids)
            if total >= self.max_context:
                raise ValueError(
                    f"context of {total} tokens reaches the model's limit of {self.max_context}"
                )
            if self.cache.n_chunks(total + 1) > self.cache.gpu.num_blocks:
                raise ValueError(
                    f"context of {total} tokens does not fit the KV cache "
                    f"({self.cache.gpu.num_blocks} chunks of {self.cache.chunk_size})"
                )
            now = time.time()
            self.clock.touch(conv.id, now)
            conv.busy = True
            req = Request(
                turn=turn,
                conv=conv,
                seq=next(self._seq),
                base=conv.kv_len,
                tokens=conv.tail + list(turn.prompt_token_ids),
                stats=TurnStats(prompt_tokens=len(turn.prompt_token_ids), arrival_s=now),
                generator=make_generator(turn.sampling),
                on_token=on_token,
            )
            conv.tail = []
            if self.owns_history:
                self.history.append(conv.id, list(turn.prompt_token_ids))
            self.counters["prompt_tokens"] += len(turn.prompt_token_ids)
            self.scheduler.add(req)
            return req

    def _resync(self, conv: Conversation, length: int) -> None:
        """The caller's durable history says the stream has `length` tokens before this turn."""
        if length < conv.length and length >= conv.kv_len:
            del conv.tail[length - conv.kv_len :]
        elif length < conv.length:
            self.cache.truncate(conv, length)
            conv.tail = []
        else:  # longer than we know (e.g. a restart): all of it comes back from history
            self.cache.reset(conv, length)
            conv.tail = []
        conv.length = length

    def _fetch(self, req: Request, n: int) -> bool:
        """True once req.prefix holds history [0, n); else read it off the step loop."""
        if req.prefix is not None and len(req.prefix) >= n:
            return True
        if self.owns_history:  # in memory: no I/O to wait for
            req.prefix = self.history.read(req.conv.id, 0, req.base)
            return True
        if req.fetch is None:
            req.fetch = self._reader.submit(self.history.read, req.conv.id, 0, req.base)
            return False
        if not req.fetch.done():
            return False
        fut, req.fetch = req.fetch, None
        req.prefix = fut.result()  # a failed read raises here; the engine fails the turn
        return len(req.prefix) >= n

    def cancel(self, req: Request) -> None:
        req.cancelled = True

    def free(self, conversation_id: str) -> None:
        """Forget a conversation's cache (its turns must have ended)."""
        with self.lock:
            conv = self.cache.convs.get(conversation_id)
            if conv is not None and conv.busy:
                raise ConversationBusy(f"conversation {conversation_id!r} has a turn in flight")
            self.cache.forget(conversation_id)
            if self.owns_history:
                self.history.forget(conversation_id)

    # ---- the step loop -----------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Request]:
        """Plan and run one batch; returns the turns that ended in it."""
        with self.lock:
            ended = self._drop_cancelled()
            try:
                pieces = self.scheduler.schedule()
            except Exception as e:  # a failed history read: fail that turn only
                ended += self._fail_fetches(e)
                return ended
            for req in self.scheduler.full:  # no room to generate more: ends as if by max_tokens
                if req.status == RUNNING:
                    self._end(req, "length", time.time())
                    ended.append(req)
            self.scheduler.full.clear()
            plan = self.cache.take_plan()
            if pieces:
                tokens = self.runner.step(pieces, plan)
            else:
                self.pool.begin_step(plan)
                tokens = []
            now = time.time()
            sampled = iter(tokens)
            for p in pieces:
                conv = p.req.conv
                conv.kv_len = max(conv.kv_len, p.end)
                if p.sample:
                    ended += self._accept(p.req, next(sampled), now)
            self.cache.swap_out_ahead(busy=self.pool.swap_in_busy())
            self.pool.end_step(self.cache.take_plan())
            self.counters["steps"] += 1
            return ended

    def _accept(self, req: Request, token: int, now: float) -> list[Request]:
        if not req.output:
            req.stats.first_token_s = now
        req.tokens.append(token)
        req.output.append(token)
        req.stats.completion_tokens += 1
        self.counters["generated_tokens"] += 1
        if req.on_token is not None:
            req.on_token(token)
        sp = req.turn.sampling
        reason = None
        if not sp.ignore_eos and (token in self.stop_token_ids or token in sp.stop_token_ids):
            reason = "stop"
        elif len(req.output) >= sp.max_tokens or req.total >= self.max_context:
            reason = "length"
        if reason is None:
            req.pending.append((req.total - 1, req.total))
            return []
        self._end(req, reason, now)
        return [req]

    def _end(self, req: Request, reason: str, now: float) -> None:
        self.scheduler.finish(req, reason)
        req.stats.finish_s = now
        if not req.output:
            req.stats.first_token_s = now
        self.clock.touch(req.conv.id, now)
        if self.owns_history:
            self.history.append(req.conv.id, req.output)

    def _drop_cancelled(self) -> list[Request]:
        ended = []
        now = time.time()
        for req in [*self.scheduler.running, *self.scheduler.waiting]:
            if req.cancelled and req.status != FINISHED:
                self._end(req, "cancelled", now)
                ended.append(req)
        return ended

    def _fail_fetches(self, error: Exception) -> list[Request]:
        ended = []
        for req in list(self.scheduler.waiting):
            if req.fetch is not None and req.fetch.done() and req.fetch.exception() is not None:
                log.error("history read for %s failed: %s", req.conv.id, req.fetch.exception())
                req.fetch = None
                req.error = error  # type: ignore[attr-defined]
                self._end(req, "error", time.time())
                ended.append(req)
        if not ended:
            raise error
        return ended

    def wait_for_io(self, timeout: float = 0.05) -> None:
        """Nothing could be scheduled: wait until a history read finishes."""
        futures = [r.fetch for r in self.scheduler.waiting if r.fetch is not None]
        if futures:
            wait(futures, timeout=timeout)
        else:
            time.sleep(timeout / 10)

    def run(self, turns: list[Turn]) -> list[TurnResult]:
        reqs = [self.submit(t) for t in turns]
        while any(r.status != FINISHED for r in reqs):
            before = self.counters["steps"]
            ended = self.step()
            if not ended and not any(r.status == RUNNING for r in reqs):
                self.wait_for_io()
            del before
        return [r.result() for r in reqs]

    # ---- inspection --------------------------------------------------------------------------

    def snapshot(self) -> dict:
        with self.lock:
            now = time.time()
            c = self.cache
            convs = []
            for conv in c.convs.values():
                last = self.clock.last_active(conv.id)
                convs.append(
                    {
                        "id": conv.id,
                        "tokens": conv.length,
                        "chunks": conv.tiers(),
                        "running": conv.pinned,
                        "idle_s": None if last is None else max(0.0, now - last),
                        "retention": c.lowest_value(conv, now),
                    }
                )
            counters = {
                **vars(c.counters),
                **self.counters,
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
            }
            return {
                "device": str(self.device),
                "model": self.config.model,
                "chunk_size": c.chunk_size,
                "cache_mode": self.config.cache_mode,
                "eviction": self.config.eviction,
                "pools": {
                    "gpu": {
                        "total": c.gpu.num_blocks,
                        "used": c.gpu.num_used,
                        "free": c.gpu.num_free,
                    },
                    "cpu": {
                        "total": c.cpu.num_blocks,
                        "used": c.cpu.num_used,
                        "free": c.cpu.num_free,
                    },
                },
                "counters": counters,
                "conversations": convs,
            }

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)
