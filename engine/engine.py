"""The engine: turns in, tokens out; each conversation's KV kept across turns."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import replace

import torch

from engine.cache.manager import KVCacheManager, chain_hashes
from engine.cache.policy import CostModel, Policy
from engine.cache.profile import load_or_profile
from engine.disk import DiskIndex, DiskTier, Loaded, namespace
from engine.errors import ConversationBusy
from engine.graphs import DecodeGraphs, bucket_sizes
from engine.guide import Guides, check
from engine.kv_pool import KVPool
from engine.model.loader import cache_root, load
from engine.model.packed import pack_linears
from engine.persistence import ActivityClock, LocalClock, MemoryHistory, TokenHistory
from engine.request import Request, Status
from engine.runner import Runner
from engine.sampler import make_generator
from engine.scheduler import Fetch, Scheduler
from engine.sim import is_simulated
from engine.snapshot import (
    ConversationInfo,
    EngineCounters,
    EngineSnapshot,
    PoolUsage,
    SharingUsage,
)
from engine.stream import Claims, StreamState
from engine.types import EngineConfig, FinishReason, Turn, TurnResult, TurnStats
from kernels import pick_backend

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _pool_sizes(
    config: EngineConfig,
    bytes_per_block: int,
    device: torch.device,
    simulated: tuple[int, int] | None = None,
) -> tuple[int, int]:
    """Tiers in blocks: the config's, else from free memory (a simulated device's own)."""
    gpu, cpu = config.gpu_cache_chunks, config.cpu_cache_chunks
    if simulated is not None:
        gpu = simulated[0] if gpu is None else gpu
        cpu = simulated[1] if cpu is None else cpu
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


def _dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def _check_kv_dtype(kv_dtype: str, backend: str, device: torch.device) -> None:
    """Triton converts to and from e4m3 only on GPUs with native fp8 (compute capability 8.9+)."""
    if kv_dtype != "fp8" or backend != "triton" or device.type != "cuda":
        return
    if torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError("kv_dtype='fp8' needs a GPU of compute capability 8.9+; use 'int8'")


class Engine:
    """Synchronous core. `run` serves a batch of turns; `submit` + `step` drive it finely."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        history: TokenHistory | None = None,
        clock: ActivityClock | None = None,
        now: Callable[[], float] | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        config.validate()
        self.tp = None  # tensor parallelism: the other ranks (engine/parallel.py)
        self.sim = None  # on "sim:<device>": the cost model and virtual clock (engine/sim)
        if is_simulated(config.device):
            self._simulate(config)
        else:
            self._load_model(config)
        # Every time the engine and its parts read: wall time, or a simulation's virtual time.
        self.now = self.sim.clock if self.sim else time.time if now is None else now
        self.max_context = self.args.max_context  # a sliding window caps it
        self.backend = None if self.sim else pick_backend(self.device, config.attention_backend)

        cs = config.chunk_size
        kv = config.kv_dtype
        _check_kv_dtype(kv, self.backend, self.device)
        pool_args = self.args if self.tp is None else self.tp.args  # a rank's KV heads
        per_block = KVPool.bytes_per_block(pool_args, cs, self.dtype, kv)
        simulated = None if self.sim is None else self.sim.pool_sizes(per_block)
        gpu, cpu = _pool_sizes(config, per_block, self.device, simulated)
        if self.sim is not None:
            self.pool = self.sim.pool(per_block, cpu)
        elif self.tp is None:
            self.pool = KVPool(self.args, gpu, cpu, cs, self.device, self.dtype, kv)
        else:
            self.pool = self.tp.pool(gpu, cpu, self.backend)
        cpu = self.pool.cpu_blocks  # may be less than asked: pinned memory is limited
        self.owns_history = history is None
        self.history = MemoryHistory() if history is None else history
        self.clock = LocalClock(self.now) if clock is None else clock
        self.counters = EngineCounters()  # the cache and prefetch add to it too
        costed = config.eviction != "lru" and config.cache_mode != "stateless"
        if costed and self.sim:
            cost = self.sim.policy_cost(cs, config.max_batch_tokens)
        elif costed:
            cost = self.measured_cost()
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
            now=self.now,
            share=config.share_prefixes,
            counters=self.counters,
        )
        cuda = self.device.type == "cuda" or (self.sim is not None and self.sim.gpu)
        share = config.prefetch_share
        if share is None:
            share = 0.25 if cuda else 0.0
        quantum = config.prefetch_step_tokens
        if quantum is None:
            quantum = config.max_batch_tokens if cuda else 4 * cs
        self.scheduler = Scheduler(
            self.cache,
            config.max_batch_tokens,
            config.max_running,
            config.unified,
            self._fetch,
            prefetch_share=share,
            prefetch_step_tokens=quantum,
            now=self.now,
        )
        if self.sim is not None:
            self.runner = self.sim.runner(self.pool)
        elif self.tp is None:
            self.runner = Runner(self.model, self.pool, cs, self.backend)
        else:
            self.runner = self.tp.runner(self.model, self.pool, self.backend)
        # Constrained decoding: the llguidance tokenizer is built on the first guided turn.
        self.guides = (
            None if self.sim else Guides(self.tokenizer, self.args.vocab_size, self.stop_token_ids)
        )
        if self.guides is not None:
            self.runner.guides = self.guides
        if config.compile_cpu and self.sim is None:
            self._compile_cpu()
        if self.graphs_enabled:
            self.runner.graphs = DecodeGraphs(
                self.model,
                self.pool,
                self.backend,
                bucket_sizes(min(config.max_running, config.max_batch_tokens)),
                width=min(-(-self.max_context // cs), gpu),
                vocab=self.args.vocab_size,
            )
            self.runner.graphs.capture()
        self.streams: dict[str, StreamState] = {}  # written here only
        self.claims = Claims()  # one turn per conversation at a time, for every front
        self._seq = itertools.count()
        self._reader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="history")
        self.disk: DiskIndex | None = None
        if config.disk_cache_dir and config.cache_mode == "pensieve":
            self.disk = self._disk_tier(config, cost)
            self.cache.spilling = True
            self.cache.policy.restore_s = self._disk_restore_s
        self.lock = threading.RLock()  # guards all state below; held for a whole step

    def measured_cost(self) -> CostModel:
        """Cost(l) of this model on this device: its profile, read from the file kept per
        model and device (profiled now, into it, the first time)."""
        return load_or_profile(
            self.model,
            self.config.model if self.tp is None else self.tp.profile_name,
            self.config.chunk_size,
            self.max_context,
            self.device,
            self.dtype,
            cache_root(self.config.cache_dir),
            self.backend,
        )

    def _compile_cpu(self) -> None:
        """The forward compiled by Inductor (engine/model/compiled.py), compiled now; where
        it cannot serve (not the CPU, an 8-bit pool, ranks), eager."""
        from engine.model.compiled import CompiledForward, usable

        if self.tp is None and usable(self.model, self.pool.layers):
            compiled = CompiledForward(self.model, self.pool.layers)
            try:
                compiled.warm_up()
                self.runner.compiled = compiled
            except Exception as e:  # no C++ compiler, an op Inductor cannot lower: any failure
                log.warning("compile_cpu: the forward did not compile (%s); it runs eagerly", e)
        else:
            log.warning("compile_cpu serves a CPU model over a 16-bit or float32 pool, one rank")

    def _disk_tier(self, config: EngineConfig, cost: CostModel) -> DiskIndex:
        """Files under `disk_cache_dir`; on a simulated device none (the directory only
        turns the tier on), and the time its drive takes."""
        size, cs = int(config.disk_cache_gb * 1e9), config.chunk_size
        if self.sim is not None:
            return self.sim.disk(size, self.pool.bytes_per_chunk, cost, cs)
        space = namespace(
            config.model, str(self.dtype), config.kv_dtype, cs, self.args.n_layers,
            self.args.n_kv_heads, self.args.head_dim,
        )  # fmt: skip
        return DiskTier(config.disk_cache_dir, size, space, cost, cs)

    def _disk_restore_s(self) -> float | None:
        """Seconds to read a chunk back from the disk tier (None: it is not writing)."""
        if self.disk is None or not self.disk.writable:
            return None
        return self.disk.read_s(self.pool.bytes_per_chunk) or None

    def _load_model(self, config: EngineConfig) -> None:
        """The model, its tokenizer and its device (a tensor-parallel one: rank 0's share)."""
        self.device = torch.device(
            config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        )
        self._use_device()
        self.dtype = _dtype(config.dtype, self.device)
        if config.tensor_parallel > 1 or config.force_tensor_parallel:
            from engine.parallel import TensorParallel

            self.tp = TensorParallel(config, self.device, self.dtype)
            self.device = self.tp.device  # rank 0's own GPU, with its index
            loaded = self.tp.load()  # rank 0's shard; args stay the full model's
        else:
            loaded = load(config.model, self.device, self.dtype, config.cache_dir, config.seed)
        self.model, self.args = loaded.model, loaded.args
        self.tokenizer = loaded.tokenizer
        self.stop_token_ids = loaded.stop_token_ids
        if config.pack_cpu_weights:
            pack_linears(self.model)  # CPU layers only; a no-op elsewhere

    def _simulate(self, config: EngineConfig) -> None:
        """No model: its shape, and the device's cost model in place of the forward."""
        from engine.sim.simulated import Simulated

        self.sim = Simulated(config)
        self.device = torch.device("cpu")  # where the few tensors the engine makes live
        self.dtype = _DTYPES[self.sim.dtype]
        self.model, self.args, self.tokenizer = None, self.sim.args, None
        self.stop_token_ids = ()

    @property
    def graphs_enabled(self) -> bool:
        """Decode steps from CUDA graphs: asked for, on CUDA, with the triton backend, one rank."""
        return (
            self.config.cuda_graphs
            and self.device.type == "cuda"
            and self.backend == "triton"
            and self.tp is None
        )

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
        if turn.sampling.guide is not None:
            if self.sim is not None:
                raise ValueError(
                    "a simulated device cannot follow a guide: it samples no real tokens"
                )
            if turn.sampling.ignore_eos:
                raise ValueError("a guided turn ends when its grammar does: no ignore_eos")
            check(turn.sampling.guide)
        if turn.context_len is not None and (
            not isinstance(turn.context_len, int) or turn.context_len < 0
        ):
            raise ValueError("context_len must be a non-negative integer")

    @property
    def context_limit(self) -> int:
        """Most tokens one conversation can hold: the model's positions, and the whole GPU
        tier (a turn's context must fit there while it runs, with room for one more)."""
        cache = self.cache
        return min(self.max_context, cache.gpu.num_blocks * cache.chunk_size) - 1

    def accept(self, turn: Turn) -> None:
        """Check the turn (`validate`) and claim its conversation (ConversationBusy if a turn
        of it is in flight). Needs no step: the async front calls it on its event loop."""
        self.validate(turn)
        self.claims.claim(turn.conversation_id)

    def submit(
        self, turn: Turn, on_token: Callable[[int], None] | None = None, accepted: bool = False
    ) -> Request:
        """Queue a turn; `accepted`: the caller ran `accept` for it already."""
        if not accepted:
            self.accept(turn)
        try:
            return self._queue(turn, on_token)
        except BaseException:
            self.claims.release(turn.conversation_id)
            raise

    def _queue(self, turn: Turn, on_token: Callable[[int], None] | None) -> Request:
        # Built outside the lock: a large grammar takes a while (llguidance drops the GIL).
        guide = None if turn.sampling.guide is None else self.guides.matcher(turn.sampling.guide)
        with self.lock:
            state = self.streams.get(turn.conversation_id)
            state = state or StreamState(turn.conversation_id, claims=self.claims)
            length = state.length if turn.context_len is None else turn.context_len
            total = length + len(turn.prompt_token_ids)
            if total >= self.max_context:
                raise ValueError(
                    f"context of {total} tokens reaches the model's limit of {self.max_context}"
                )
            if self.cache.n_chunks(total + 1) > self.cache.gpu.num_blocks:
                raise ValueError(
                    f"context of {total} tokens does not fit the KV cache "
                    f"({self.cache.gpu.num_blocks} chunks of {self.cache.chunk_size})"
                )
            self.streams[state.id] = state
            table = self.cache.table(state.id)
            # Its prefetch ends; a running one goes on if the context stays, to be taken over.
            prefetch = self.scheduler.prefetch.supersede(state.id, keep=length == state.length)
            if length != state.length:
                self._resync(state, length)
            now = self.now()
            if state.idle_since is not None:  # what the `returns` eviction value learns from
                self.cache.policy.returns.returned(now - state.idle_since)
            self.clock.touch(state.id, now)
            prompt = list(turn.prompt_token_ids)
            chain: list[bytes] = []
            shared = 0
            if self.cache.share and state.length == 0 and not table.chunks:
                # A conversation starts: link the shared chunks its prompt starts with (its
                # last token is always computed, for the logits of the first reply token).
                chain = chain_hashes(prompt, self.cache.chunk_size)
                linkable = (len(prompt) - 1) // self.cache.chunk_size
                shared = state.kv_len = self.cache.link(table, chain[:linkable])
            req = Request(
                turn=turn,
                state=state,
                table=table,
                seq=next(self._seq),
                base=state.kv_len,
                tokens=state.tail + prompt[shared:],
                stats=TurnStats(prompt_tokens=len(prompt), shared_tokens=shared, arrival_s=now),
                generator=make_generator(turn.sampling, self.device),
                on_token=on_token,
                chain=chain,
                guide=guide,
            )
            state.tail = []
            if self.owns_history:
                self.history.append(state.id, list(turn.prompt_token_ids))
            self.counters.prompt_tokens += len(turn.prompt_token_ids)
            self.scheduler.add(req, prefetch)
            return req

    # ---- prefetch ----------------------------------------------------------------------------

    def prefetch(self, conversation_id: str) -> None:
        """The user of an idle conversation is typing: a hint for the scheduler's prefetch
        (`engine/prefetch.py`) to start bringing its context back to the GPU tier at low
        priority, so that the message that follows finds it there. A no-op for unknown,
        busy or already prefetching conversations, the baseline cache modes, and a context
        that is all on the GPU already."""
        with self.lock:
            state = self.streams.get(conversation_id)
            if state is None:
                return
            now = self.now()
            if self.scheduler.prefetch.hint(state, next(self._seq), now):
                self.clock.touch(conversation_id, now)  # its chunks are worth keeping now

    def fork(
        self, parent_id: str, child_id: str, token_ids: list[int], parent_len: int | None = None
    ) -> int:
        """Start conversation `child_id` as a copy of the first `len(token_ids)` tokens of
        `parent_id`'s stream (`token_ids` are those tokens): the parent's full chunks of them
        are published (`KVCacheManager.publish`) and the child links them instead of
        computing them again; its first turn computes only the rest. `parent_len`: the
        parent's stream length as its caller's history has it; the engine links nothing
        when its own copy of the parent differs. Returns the positions linked; 0 (a busy,
        unknown or partly dropped parent, sharing off) leaves the child unknown, so its
        first turn recomputes its context from history like any conversation after a
        restart."""
        with self.lock:
            if child_id in self.streams or self.cache.tables.get(child_id) is not None:
                raise ValueError(f"conversation {child_id!r} exists already")
            parent = self.streams.get(parent_id)
            table = self.cache.tables.get(parent_id)
            cs = self.cache.chunk_size
            if (
                not self.cache.share
                or parent is None
                or table is None
                or parent.busy
                or (parent_len is not None and parent.length != parent_len)
                or len(token_ids) > parent.length
            ):
                return 0
            chain = chain_hashes(list(token_ids), cs)
            n = min(len(chain), parent.kv_len // cs)
            self.cache.publish(table, chain[:n])
            child = self.cache.table(child_id)
            linked = self.cache.link(child, chain[:n])
            if not linked:
                self.cache.forget(child_id)
                return 0
            full = len(token_ids) // cs * cs
            self.streams[child_id] = StreamState(
                child_id, length=len(token_ids), kv_len=linked, tail=list(token_ids[linked:]),
                hashes=chain[: full // cs], unhashed=list(token_ids[full:]), claims=self.claims,
            )  # fmt: skip
            if self.owns_history:
                self.history.append(child_id, list(token_ids))
            self.clock.touch(child_id, self.now())
            return linked

    def _resync(self, state: StreamState, length: int) -> None:
        """The caller's durable history says the stream has `length` tokens before this turn."""
        table = self.cache.table(state.id)
        cs = self.cache.chunk_size
        if length < state.length:  # cut back: its hashes as far as they still hold
            keep = length // cs
            if keep < len(state.hashes):  # the tokens of a cut chunk are not kept
                del state.hashes[keep:]
                state.unhashed = [] if length % cs == 0 else None
            elif state.unhashed is not None:
                state.unhashed = state.unhashed[: length - keep * cs]
        elif length > state.length:
            state.hashes, state.unhashed = [], None
        if length < state.length and length >= state.kv_len:
            del state.tail[length - state.kv_len :]
        elif length < state.length:
            self.cache.truncate(table, length)
            state.kv_len = min(state.kv_len, length)
            state.tail = []
        else:  # longer than we know (e.g. a restart): all of it comes back from history
            self.cache.reset(table, length)
            state.kv_len = length
            state.tail = []
        state.length = length

    def _fetch(self, req: Request, n: int) -> Fetch:
        """READY once req.prefix holds history [0, n) (and, with a disk tier, req.loaded what
        the disk tier has of the table's dropped run as it is now); PENDING while it is read
        off the step loop; FAILED (with req.error) if the read failed: a status, never an
        exception."""
        if req.fetch is not None:
            if not req.fetch.done():
                return Fetch.PENDING
            fut, req.fetch = req.fetch, None
            error = fut.exception()
            if error is not None:
                req.error = error
                return Fetch.FAILED
            req.prefix, req.loaded = fut.result()
        dropped = self.cache.loadable(req.table) if self.disk is not None else 0
        fresh = not dropped or req.read_for == dropped  # more dropped since: read again
        if req.prefix is None or len(req.prefix) < n or not fresh:
            if req.read_for == dropped and req.prefix is not None:
                pass  # read for this state already: the history is short
            elif self.owns_history and not dropped:  # in memory: no I/O to wait for
                try:
                    req.prefix = self.history.read(req.state.id, 0, req.base)
                except Exception as e:
                    req.error = e
                    return Fetch.FAILED
            else:
                req.read_for = dropped
                args = (req.state.id, req.base, dropped, req.prefix)
                if self.sim is None:
                    req.fetch = self._reader.submit(self._read_back, *args)
                else:  # read now, ready when the simulated disk would have read it
                    req.fetch = self.sim.read_later(self.disk, self._read_back, *args)
                if not req.fetch.done():
                    return Fetch.PENDING
                return self._fetch(req, n)  # nothing to wait for
        if len(req.prefix) < n:
            req.error = LookupError(
                f"history of {req.state.id!r} has {len(req.prefix)} tokens, {n} are needed"
            )
            return Fetch.FAILED
        return Fetch.READY

    def _read_back(
        self, cid: str, base: int, dropped: int, prefix: list[int] | None = None
    ) -> tuple[list[int], Loaded | None]:
        """Off the step loop: the history [0, base) (unless `prefix` holds it), and the last
        chunks of a dropped run of `dropped` chunks from the disk tier where that is cheaper
        than recomputing them."""
        if prefix is None or len(prefix) < base:
            prefix = self.history.read(cid, 0, base)
        if not dropped or self.disk is None:
            return prefix, None
        cs = self.cache.chunk_size
        keys = chain_hashes(prefix[: dropped * cs], cs)
        whole = dropped * cs >= base  # nothing after the dropped run is held
        loaded = self.disk.load(keys, dropped, self.pool.bytes_per_chunk, whole)
        if loaded is not None and self.device.type == "cuda":  # copied layer by layer, async
            loaded.parts = {j: [p.pin_memory() for p in ps] for j, ps in loaded.parts.items()}
        return prefix, loaded

    def cancel(self, req: Request) -> None:
        req.cancelled = True

    def free(self, conversation_id: str, erase: bool = False) -> None:
        """Forget a conversation's cache (its turns must have ended). `erase`: remove its
        chunks from the disk tier too (a deleted conversation's; another conversation that
        starts the same way recomputes what it shared)."""
        with self.lock:
            state = self.streams.get(conversation_id)
            if state is not None and state.busy:
                raise ConversationBusy(f"conversation {conversation_id!r} has a turn in flight")
            if erase and state is not None and self.disk is not None:
                for j, key in enumerate(state.hashes):
                    self.disk.remove(key, j)
            self.scheduler.prefetch.supersede(conversation_id, keep=False)
            self.streams.pop(conversation_id, None)
            self.cache.forget(conversation_id)
            if self.owns_history:
                self.history.forget(conversation_id)

    # ---- the step loop -----------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def _use_device(self) -> None:
        """Make the engine's GPU the calling thread's current one: Triton launches, events
        and graph captures go to the current device, not to their tensors' (cuda:1 ...)."""
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)

    def step(self) -> list[Request]:
        """Plan and run one batch; returns the turns that ended in it."""
        self._use_device()  # steps may run on another thread than the one that built it
        with self.lock:
            ended = self._drop_cancelled()
            plan = self.scheduler.schedule(swap_in_busy=self.pool.swap_in_busy())
            self._spill()
            now = self.now()
            for req in plan.failed:  # its history could not be read: that turn alone fails
                log.error("history read for %s failed: %s", req.state.id, req.error)
                self._end(req, FinishReason.ERROR, now)
                ended.append(req)
            for req in plan.full:  # no room to generate more: ends as if by max_tokens
                if req.status == Status.RUNNING:
                    self._end(req, FinishReason.LENGTH, now)
                    ended.append(req)
            if plan.pieces:
                tokens = self.runner.step(plan.pieces, plan.before)
            else:
                self.pool.begin_step(plan.before)
                self.pool.swap_in_now()  # no forward to pipeline it with
                tokens = []
            now = self.now()
            sampled = iter(tokens)
            for p in plan.pieces:
                state = p.req.state
                state.kv_len = max(state.kv_len, p.end)
                if p.sample:
                    ended += self._accept(p.req, next(sampled), now)
            self.scheduler.computed(plan)
            self.pool.end_step(plan.after)
            for req in ended:  # after the step's copies: publishing may free blocks
                if req.chain and req.finish_reason is not FinishReason.ERROR:
                    n = req.state.kv_len // self.cache.chunk_size
                    self.cache.publish(req.table, req.chain[:n])
            self.counters.steps += 1
            return ended

    def _spill(self) -> None:
        """Chunks the cache dropped in this step's planning go to the disk tier: copied out
        of their blocks before this step's copies and forward reuse them, written by the
        disk tier's thread."""
        spills = self.cache.take_spills()
        if self.disk is None or not spills:
            return
        for cid, i, tier, block in spills:
            state = self.streams.get(cid)
            if state is None or i >= len(state.hashes) or not self.disk.writable:
                continue
            if state.hashes[i] in self.disk.index:
                continue
            self.disk.put(state.hashes[i], i, self.pool.read_block(tier, block))

    def _accept(self, req: Request, token: int, now: float) -> list[Request]:
        if not req.output:
            req.stats.first_token_s = now
        req.tokens.append(token)
        req.output.append(token)
        req.stats.completion_tokens += 1
        self.counters.generated_tokens += 1
        if req.on_token is not None:
            req.on_token(token)
        sp = req.turn.sampling
        reason = None
        if req.guide is not None and not self._guided(req, token):
            reason = FinishReason.ERROR
        elif not sp.ignore_eos and (token in self.stop_token_ids or token in sp.stop_token_ids):
            reason = FinishReason.STOP
        elif len(req.output) >= sp.max_tokens or req.total >= self.max_context:
            reason = FinishReason.LENGTH
        if reason is None:
            req.pending.append((req.total - 1, req.total))
            return []
        self._end(req, reason, now)
        return [req]

    def _guided(self, req: Request, token: int) -> bool:
        """The turn's matcher takes its token; False (the turn fails) if the grammar refuses
        it, which its mask should have made impossible."""
        try:
            req.guide.consume(token)
        except ValueError as e:
            log.error("turn of %s: %s", req.state.id, e)
            req.error = e
            return False
        return True

    def _end(self, req: Request, reason: FinishReason, now: float) -> None:
        self.scheduler.finish(req, reason)
        self._close(req, now)

    def _close(self, req: Request, now: float) -> None:
        """The turn ended: its stream goes on from its tokens, and it is free again."""
        state = req.state
        state.length = req.total
        state.tail = req.tokens[state.kv_len - req.base :]
        self.claims.release(state.id)
        self._hash(state, req)
        req.guide = None  # its matcher is freed with it
        req.stats.finish_s = now
        if not req.output:
            req.stats.first_token_s = now
        self.clock.touch(state.id, now)
        state.idle_since = now
        self.cache.policy.returns.ended()
        if self.owns_history:
            self.history.append(state.id, req.output)

    def _hash(self, state: StreamState, req: Request) -> None:
        """Extend the stream's chunk hashes over the turn's tokens (from the history read
        for it when the tokens before it are not known)."""
        cs = self.cache.chunk_size
        done = len(state.hashes) * cs
        known = done + len(state.unhashed or [])
        if state.unhashed is not None and req.base <= known <= req.total:
            tokens = state.unhashed + req.tokens[known - req.base :]
        elif req.prefix is not None and len(req.prefix) >= req.base:
            state.hashes, done = [], 0
            tokens = list(req.prefix[: req.base]) + req.tokens
        else:  # the tokens before this turn are unknown here: the keys stop
            return
        full = len(tokens) // cs * cs
        prev = state.hashes[-1] if state.hashes else b""
        state.hashes += chain_hashes(tokens[:full], cs, prev)
        state.unhashed = tokens[full:]

    def _drop_cancelled(self) -> list[Request]:
        ended = []
        now = self.now()
        for req in [*self.scheduler.running, *self.scheduler.waiting]:
            if req.cancelled and req.status != Status.FINISHED:
                self._end(req, FinishReason.CANCELLED, now)
                ended.append(req)
        return ended

    def fail_all(self, error: BaseException) -> list[Request]:
        """End every turn in flight with `error` (a step failed: the state may be broken);
        returns them."""
        with self.lock:
            failed = self.scheduler.fail_all(error)
            now = self.now()
            for req in failed:
                try:
                    self._close(req, now)
                except Exception:  # the turn is failed regardless
                    log.exception("could not close %s", req.state.id)
                    self.claims.release(req.state.id)
            return failed

    def _reads(self) -> list:
        """The history (and disk tier) reads of queued turns."""
        queued = [*self.scheduler.waiting, *self.scheduler.prefetch.queue]
        return [r.fetch for r in queued if r.fetch is not None]

    def next_read_s(self) -> float | None:
        """A simulated engine: the virtual time the first read still running ends (None:
        none is)."""
        if self.sim is None:
            return None
        now = self.now()
        return min((f.due for f in self._reads() if f.due > now), default=None)

    def wait_for_io(self, timeout: float = 0.05) -> None:
        """Nothing could be scheduled: wait until a history read finishes (simulated: move
        the virtual clock to its end)."""
        if self.sim is not None:
            due = self.next_read_s()
            if due is not None:
                self.sim.clock.advance_to(due)
            return
        futures = self._reads()
        if futures:
            wait(futures, timeout=timeout)
        else:
            time.sleep(timeout / 10)

    def run(self, turns: list[Turn]) -> list[TurnResult]:
        reqs = [self.submit(t) for t in turns]
        while any(r.status != Status.FINISHED for r in reqs):
            ended = self.step()
            if not ended and not any(r.status == Status.RUNNING for r in reqs):
                self.wait_for_io()
        return [r.result() for r in reqs]

    # ---- inspection --------------------------------------------------------------------------

    def snapshot(self) -> EngineSnapshot:
        with self.lock:
            now = self.now()
            c = self.cache
            convs = []
            on_disk = self.disk.keys() if self.disk is not None else set()
            for table in c.tables.values():
                last = self.clock.last_active(table.id)
                state = self.streams.get(table.id)
                convs.append(
                    ConversationInfo(
                        id=table.id,
                        tokens=0 if state is None else state.length,
                        chunks=self._tiers(table, state, on_disk),
                        holders=tuple(c.holders(table)),
                        running=table.pinned,
                        idle_s=None if last is None else max(0.0, now - last),
                        retention=c.lowest_value(table, now),
                    )
                )
            return EngineSnapshot(
                device=str(self.device),
                model=self.config.model,
                chunk_size=c.chunk_size,
                cache_mode=self.config.cache_mode,
                eviction=self.config.eviction,
                gpu=PoolUsage(c.gpu.num_blocks, c.gpu.num_used, c.gpu.num_free),
                cpu=PoolUsage(c.cpu.num_blocks, c.cpu.num_used, c.cpu.num_free),
                counters=replace(
                    self.counters,
                    running=len(self.scheduler.running),
                    waiting=len(self.scheduler.waiting),
                ),
                conversations=tuple(convs),
                context_limit=self.context_limit,
                sharing=SharingUsage(
                    chunks=sum(1 for s in c.shared if len(s.holders) > 1),
                    holders=sum(len(s.holders) for s in c.shared if len(s.holders) > 1),
                ),
                disk=self._disk_usage(),
            )

    def _tiers(self, table, state: StreamState | None, on_disk: set[bytes]) -> tuple[str, ...]:
        """Each chunk's tier; a dropped chunk the disk tier holds is on "disk"."""
        tiers = table.tiers()
        if on_disk and state is not None:
            for j in range(min(table.n_dropped, len(state.hashes))):
                if state.hashes[j] in on_disk:
                    tiers[j] = "disk"
        return tuple(tiers)

    def _disk_usage(self) -> PoolUsage | None:
        if self.disk is None:
            return None
        chunk = max(1, self.pool.bytes_per_chunk)
        total = self.disk.capacity // chunk
        used = min(total, self.disk.bytes // chunk)
        return PoolUsage(total, used, total - used)

    def write_back(self, limit: int | None = None) -> int:
        """Write the full chunks held in memory that the disk tier lacks, of idle
        conversations: all of them and wait (a graceful stop: the next process reads them
        instead of recomputing), or at most `limit` without waiting (while the engine is
        idle, so that a crash loses little). Returns the chunks queued."""
        if self.disk is None or not self.disk.writable:
            return 0
        n, held = 0, self.disk.keys()
        with self.lock:
            for t in list(self.cache.tables.values()):
                state = self.streams.get(t.id)
                if state is None or t.pinned:
                    continue
                for j, c in enumerate(t.chunks[: len(state.hashes)]):
                    tier = "gpu" if c.gpu is not None else "cpu" if c.cpu is not None else None
                    if tier is None or state.hashes[j] in held:
                        continue
                    if limit is not None and n >= limit:
                        return n
                    block = c.gpu if tier == "gpu" else c.cpu
                    parts = self.pool.read_block(tier, block)
                    if not self.disk.put(state.hashes[j], j, parts, wait=limit is None):
                        return n  # the writer is behind: later
                    held.add(state.hashes[j])
                    n += 1
        if limit is None:
            self.disk.flush()
        return n

    def close(self) -> None:
        if self.disk is not None and self.sim is None:  # a simulation keeps nothing
            try:
                self.write_back()
            except Exception:  # a stop must not fail on it: the next start recomputes
                log.exception("could not write the cache back to the disk tier")
            self.disk.close()
        self._reader.shutdown(wait=False, cancel_futures=True)
        if self.guides is not None:
            self.guides.close()
        if self.tp is not None:
            self.tp.close()
