"""Tensor parallelism over torch.distributed: rank 0 is the engine, ranks 1..N-1 are worker
processes it spawns.

Rank 0 runs the scheduler and the cache bookkeeping alone. Every forward it broadcasts one
`Step` (the batch as plain lists, and the copy plans applied since the last step, in order)
on a gloo group, and every rank runs it on its own shard (engine/model/shard.py) and its own KV pool
of n_kv_heads / N heads per chunk in both tiers: a swap, drop or recompute is one decision
applied N times. The model's all-reduces and the logit gather run on the default group (NCCL
on CUDA, gloo on the CPU), with a timeout. A worker that dies fails the engine with an error
naming the rank; the workers end when the engine closes, or when rank 0 goes away.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.copies import CopyPlan
from engine.kv_layout import KVLayout
from engine.kv_pool import KVPool
from engine.model.decoder import Decoder
from engine.model.loader import Loaded, load, model_args, own_tensors
from engine.model.packed import pack_linears
from engine.model.shapes import ModelArgs
from engine.model.shard import build_shard, check_divisible, set_group, shard_args
from engine.runner import Runner, StepInputs
from engine.types import EngineConfig

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 120.0  # a rank stuck this long inside a forward fails the step
IDLE_TIMEOUT = timedelta(days=365)  # workers wait for the next step as long as the engine idles
MAX_QUEUED_OPS = 64  # copy plans of steps without a forward are sent once this many wait


class TensorParallelError(RuntimeError):
    """A rank died or a collective failed: the engine cannot run another step."""


@dataclass
class Setup:
    """What a worker needs, once rank 0 has sized the pools."""

    gpu_blocks: int
    cpu_blocks: int
    backend: str


@dataclass
class Step:
    """One message per forward: copy plans to apply in order ("begin" / "end", as
    `KVPool.begin_step` / `end_step`), then the forward over `inputs` (None: copies only)."""

    ops: list[tuple[str, CopyPlan]]
    inputs: StepInputs | None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _abort_nccl() -> None:
    """A rank is gone: end this process's NCCL communicators now, so that a collective still
    waiting for the lost peer exits and nothing later waits to flush towards it
    (`destroy_process_group` would)."""
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    try:
        if abort is not None:
            abort()
        else:
            dist.destroy_process_group()
    except Exception:
        log.exception("could not abort the NCCL process groups")


def _rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: on CUDA the r-th GPU after the engine's own ("cuda" is cuda:0), always
    with its index (NCCL binds each rank to one)."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def load_shard(config: EngineConfig, rank: int, world: int, device, dtype, group) -> Decoder:
    """Rank `rank`'s share, read (or, for dummy weights, drawn) one full tensor at a time on
    its own device: no rank ever holds the whole model, on the host or the GPU."""
    tensors = own_tensors(config.model, device, dtype, config.cache_dir, config.seed)
    return build_shard(model_args_of(config), tensors, rank, world, group).to(device)


def _init(rank: int, world: int, store: dist.Store, device: torch.device):
    """Join the default group (the model's collectives) and the control group (the steps)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda" and rank == 0:
        # NCCL's watchdog would end the engine process at a timed-out collective: rank 0
        # watches its workers itself (ParallelRunner._wait) and aborts the groups on a failure.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        **({"device_id": device} if device.type == "cuda" else {}),
    )
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def _store(port: int, world: int, master: bool) -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1",
        port,
        world,
        is_master=master,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        wait_for_workers=False,
    )


def _share_threads(device: torch.device, world: int) -> None:
    """On the CPU the ranks share the cores: one rank's threads should not starve another."""
    if device.type == "cpu" and world > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))


class TensorParallel:
    """Rank 0's side: the workers, the groups, the messages."""

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.config, self.dtype = config, dtype
        self.world = n = config.tensor_parallel
        self.full_args = model_args(config.model, config.cache_dir)
        check_divisible(self.full_args, n)
        self.args = shard_args(self.full_args, n)  # what each rank computes and caches
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"tensor parallelism runs on cpu or cuda, not {device.type}")
        self.device = _rank_device(device, 0)  # rank r runs on the GPU r after this one
        if device.type == "cuda" and torch.cuda.device_count() < self.device.index + n:
            raise ValueError(
                f"tensor_parallel={n} from {self.device} needs GPUs up to "
                f"cuda:{self.device.index + n - 1}; {torch.cuda.device_count()} are visible"
            )
        if dist.is_initialized():
            raise ValueError("another tensor-parallel engine already runs in this process")
        self.failed: TensorParallelError | None = None
        self.closed = False
        if self.device.type == "cuda":
            # This process's GPU: Triton, events and pinned registrations use the current one.
            torch.cuda.set_device(self.device)
        port = _free_port()
        ctx = mp.get_context("spawn")
        self.procs = [
            ctx.Process(
                target=_worker_main,
                args=(config, rank, n, port, self.device, dtype),
                name=f"pensieve-tp{rank}",
                daemon=True,
            )
            for rank in range(1, n)
        ]
        for p in self.procs:
            p.start()
        try:
            store = _store(port, n, master=True)
            self._wait_for_workers(store)
            self.control = _init(0, n, store, self.device)
        except BaseException:
            self.close()
            raise
        self._threads = torch.get_num_threads()
        _share_threads(self.device, n)

    def _wait_for_workers(self, store: dist.TCPStore) -> None:
        """Until every worker has reached the store; a worker that died on the way (a bad
        import, no memory) fails the engine now rather than after the rendezvous timeout."""
        keys = [f"up{rank}" for rank in range(1, self.world)]
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
        while not store.check(keys):
            if not all(p.is_alive() for p in self.procs):
                raise self.fail(None)
            if time.monotonic() > deadline:
                raise TensorParallelError("tensor-parallel workers did not start in time")
            time.sleep(0.05)

    @property
    def profile_name(self) -> str:
        """The cost profile times one rank's shard: its own key (one rank: the whole model's)."""
        return self.config.model if self.world == 1 else f"{self.config.model}-tp{self.world}"

    # ---- building the engine's parts -------------------------------------------------------

    def load(self) -> Loaded:
        """Rank 0's shard (collectives off until `runner`), with the tokenizer and the full
        model's args."""
        c = self.config
        loaded = load(c.model, self.device, self.dtype, c.cache_dir, c.seed, weights=False)
        shard = load_shard(c, 0, self.world, self.device, self.dtype, None)
        return replace(loaded, model=shard)

    def pool(
        self, gpu_blocks: int, cpu_blocks: int, backend: str, layout: KVLayout | None = None
    ) -> ParallelPool:
        """Every rank's pool of the same block counts; the CPU tier as large as the smallest
        one any rank could pin."""
        if self.config.cpu_cache_chunks is None:
            cpu_blocks //= self.world  # sized from host memory, which the ranks share
        self.send(Setup(gpu_blocks, cpu_blocks, backend))
        cs, kv = self.config.chunk_size, self.config.kv_dtype
        pool = ParallelPool(
            self, self.args, gpu_blocks, cpu_blocks, cs, self.device, self.dtype, kv, layout
        )
        got = torch.tensor([pool.cpu.shape[2]])
        dist.all_reduce(got, op=dist.ReduceOp.MIN, group=self.control)
        pool.usable_cpu_blocks = int(got)
        return pool

    def runner(self, model: Decoder, pool: ParallelPool, backend: str) -> ParallelRunner:
        set_group(model, dist.group.WORLD)
        return ParallelRunner(self, model, pool, self.config.chunk_size, backend)

    # ---- messages and failures -------------------------------------------------------------

    def check(self) -> None:
        if self.failed is not None:
            raise self.failed
        if self.closed:
            raise TensorParallelError("the tensor-parallel workers were shut down")
        dead = [p for p in self.procs if not p.is_alive()]
        if dead:
            raise self.fail(None)

    def send(self, msg: Setup | Step | None) -> None:
        self.check()
        try:
            dist.broadcast_object_list([msg], src=0, group=self.control)
        except RuntimeError as e:
            raise self.fail(e) from e

    def fail(self, error: BaseException | None) -> TensorParallelError:
        """The engine cannot go on: name the ranks that died (or the collective that failed)."""
        if self.failed is None:
            for p in self.procs:
                p.join(timeout=2.0 if error is not None else 0.0)
            dead = [
                f"rank {r} (pid {p.pid}) exited with code {p.exitcode}"
                for r, p in enumerate(self.procs, start=1)
                if p.exitcode is not None
            ]
            what = "; ".join(dead) if dead else f"a collective failed: {error}"
            self.failed = TensorParallelError(f"tensor-parallel engine stopped: {what}")
            log.error("%s", self.failed)
            if self.device.type == "cuda":
                _abort_nccl()
        return self.failed

    def close(self) -> None:
        """Stop the workers (politely when they are alive) and leave the groups."""
        if self.closed:
            return
        self.closed = True
        if self.failed is None and dist.is_initialized() and all(p.is_alive() for p in self.procs):
            try:
                dist.broadcast_object_list([None], src=0, group=self.control)
            except RuntimeError:
                log.warning("could not tell the tensor-parallel workers to stop")
        for p in self.procs:
            p.join(timeout=10.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        if dist.is_initialized():  # (after a failure on CUDA the groups are aborted already)
            dist.destroy_process_group()
        if hasattr(self, "_threads"):
            torch.set_num_threads(self._threads)


class ParallelPool(KVPool):
    """Rank 0's pool: applies the copy plans, and queues them for the other ranks (they go
    out with the next step, in the same order)."""

    def __init__(self, tp: TensorParallel, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.tp = tp
        self.ops: list[tuple[str, CopyPlan]] = []
        self.usable_cpu_blocks = self.cpu.shape[2]

    @property
    def cpu_blocks(self) -> int:
        return self.usable_cpu_blocks

    def begin_step(self, plan: CopyPlan, writes=None) -> None:
        super().begin_step(plan, writes)
        if plan.swap_out or plan.swap_in:
            self._queue("begin", plan)

    def end_step(self, plan: CopyPlan) -> None:
        super().end_step(plan)
        if plan.background:
            self._queue("end", plan)

    def _queue(self, kind: str, plan: CopyPlan) -> None:
        self.ops.append((kind, plan))
        if len(self.ops) >= MAX_QUEUED_OPS:  # a long run of steps without a forward
            self.tp.send(Step(self.take_ops(), None))

    def take_ops(self) -> list[tuple[str, CopyPlan]]:
        ops, self.ops = self.ops, []
        return ops


class ParallelRunner(Runner):
    """Rank 0's runner: sends each step before joining the sharded forward."""

    runs_ahead = False  # the workers would need the previous step's tokens: steps stay in order

    def __init__(self, tp: TensorParallel, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.tp = tp

    def begin(self, x: StepInputs, plan: CopyPlan) -> None:
        self.tp.check()
        self.pool.begin_step(plan)
        # The step's own "begin" is the last op even when its plan is empty: workers always
        # begin a forward as rank 0 did.
        ops = self.pool.take_ops()
        if not ops or ops[-1][1] is not plan:
            ops.append(("begin", plan))
        self.tp.send(Step(ops, x))

    def forward(
        self, x: StepInputs, plan: CopyPlan, sampled: torch.Tensor | None = None
    ) -> torch.Tensor:
        assert sampled is None, "tensor-parallel steps are not lagged"
        try:
            logits = super().forward(x, plan)
            if logits.is_cuda and self.tp.procs:
                self._wait()
            return logits
        except TensorParallelError:
            raise
        except RuntimeError as e:  # a collective failed: a rank died or timed out
            raise self.tp.fail(e) from e

    def _wait(self) -> None:
        """Until the step's GPU work is done, watching the workers: an NCCL collective that
        lost a peer spins on the GPU and never fails on its own (rank 0 turns NCCL's watchdog
        off, which would end the whole engine process at the timeout)."""
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
        while not done.query():
            self.tp.check()  # a dead worker: TensorParallelError, and the groups are aborted
            if time.monotonic() > deadline:
                raise self.tp.fail(TimeoutError(f"a step took over {COLLECTIVE_TIMEOUT_S} s"))


class _WorkerRunner(Runner):
    def begin(self, x: StepInputs, plan: CopyPlan) -> None:
        pass  # the step's copies were applied from its ops


def _worker_main(
    config: EngineConfig, rank: int, world: int, port: int, device: torch.device, dtype
) -> None:
    device = _rank_device(device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _share_threads(device, world)
    store = _store(port, world, master=False)
    store.set(f"up{rank}", "1")
    control = _init(rank, world, store, device)
    try:
        _serve(config, rank, world, device, dtype, control)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _recv(control):
    box = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


def _serve(config, rank, world, device, dtype, control) -> None:
    model = load_shard(config, rank, world, device, dtype, dist.group.WORLD)
    if config.pack_cpu_weights:
        pack_linears(model)
    setup: Setup | None = _recv(control)
    if setup is None:
        return
    args = shard_args(model_args_of(config), world)
    pool = KVPool(
        args,
        setup.gpu_blocks,
        setup.cpu_blocks,
        config.chunk_size,
        device,
        dtype,
        config.kv_dtype,
        KVLayout.of(args, config.window_savings),  # rank 0's: the same layers
    )
    got = torch.tensor([pool.cpu.shape[2]])
    dist.all_reduce(got, op=dist.ReduceOp.MIN, group=control)
    runner = _WorkerRunner(model, pool, config.chunk_size, setup.backend)
    while (msg := _recv(control)) is not None:
        for i, (kind, plan) in enumerate(msg.ops):
            if kind == "end":
                pool.end_step(plan)
                continue
            pool.begin_step(plan)
            if msg.inputs is None or i < len(msg.ops) - 1:
                pool.swap_in_now()  # rank 0 ran this step without a forward: no pipelining
        if msg.inputs is not None:
            runner.forward(msg.inputs, msg.ops[-1][1])


def model_args_of(config: EngineConfig) -> ModelArgs:
    return model_args(config.model, config.cache_dir)
