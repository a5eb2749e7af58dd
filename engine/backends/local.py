"""One process: the model on one device (a GPU, or the CPU standing in for one), its paged
KV pool, the runner, and the disk tier's files."""

from __future__ import annotations

import logging

import torch

from engine.backends.base import Backend
from engine.cache.policy import CostModel
from engine.cache.profile import load_or_profile
from engine.disk.files import ChunkFiles, namespace
from engine.graphs import StepGraphs, buckets
from engine.kv_layout import KVLayout
from engine.kv_pool import KVPool
from engine.model import fp16
from engine.model.compiled import CompiledForward, usable
from engine.model.gguf_weights import read_q4
from engine.model.int4 import swap_int4
from engine.model.loader import BUNDLES, Loaded, bundle_gguf, cache_root, load
from engine.model.moe import graph_safe
from engine.model.packed import pack_linears
from engine.runner import Runner
from engine.types import DENSE, EngineConfig
from kernels import pick_backend

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def pick_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {name!r}")
    return DTYPES[name]


def serving_dtype(device: str | None) -> tuple[str, str]:
    """The dtype a server picks when none is given, and why (for its log line): bfloat16 on
    CUDA, and on a CPU that computes bfloat16 natively (AVX512-BF16 or AMX: about 1.2-1.5x
    float32's tokens/s, replies within the bound tests/kernels/test_kv8.py holds it to);
    float32 on other CPUs, where bfloat16 would be emulated and slower."""
    on_cuda = device == "cuda" or (device is None and torch.cuda.is_available())
    if on_cuda:
        return "bfloat16", "on CUDA"
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "bfloat16", "this CPU computes bfloat16 natively; --dtype float32 for float32"
    return "float32", "this CPU has no native bfloat16 (AVX512-BF16 or AMX)"


def serving_weights(device: str | None, dtype: str) -> tuple[str, str]:
    """The weights a server picks when it picked the dtype too, and why: where the CPU serves
    float32, float16 linear weights with float32 math (engine/model/fp16.py: a decode step
    reads half the bytes); else the model's own ("auto")."""
    on_cpu = device == "cpu" or (device is None and not torch.cuda.is_available())
    if on_cpu and dtype == "float32" and fp16.available():
        return "float16", "float32 math; --weights float32 for float32 weights"
    return "auto", ""


# Whether "auto" weights take the GGUF's 4-bit linears where they can: no. On this kind of
# CPU (AVX512-BF16) a whole decode step of the bundled model at 8 rows is a tie with
# oneDNN's packed bfloat16 (0.97x at 2 threads, 1.01x at 1), slower at 16 rows (1.16-1.23x),
# faster only at 1 row (0.63-0.77x): bench.int4_weights at b0c129d (retired since), its
# results bench/results/int4_weights_b0c129d_*.json; bench.peer_cpu --engine
# "dtype=bfloat16 weights=gguf" measures it in a served run now.
AUTO_INT4 = False


def use_gguf(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the model's linears are the GGUF's own 4-bit weights (engine/model/int4.py):
    asked for ("gguf": refused where it cannot be), or "auto" where they win: a bundled
    GGUF (SmolLM2, Gemma 3 270M), on the CPU, in bfloat16, one process."""
    fits = (
        config.model in BUNDLES
        and device.type == "cpu"
        and config.tensor_parallel == 1
        and not config.force_tensor_parallel
    )
    if config.weights == "gguf":
        if not fits:
            raise ValueError(
                f"weights='gguf' serves the 4-bit weights of a bundled model's GGUF "
                f"({', '.join(map(repr, BUNDLES))}) on the CPU in one process; got model "
                f"{config.model!r} on {device.type}"
            )
        return True
    return config.weights == "auto" and AUTO_INT4 and fits and dtype == torch.bfloat16


def check_kv_dtype(kv_dtype: str, attention: str | None, device: torch.device) -> None:
    """Triton converts to and from e4m3 only on GPUs with native fp8 (compute capability 8.9+)."""
    if kv_dtype != "fp8" or attention != "triton" or device.type != "cuda":
        return
    if torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError("kv_dtype='fp8' needs a GPU of compute capability 8.9+; use 'int8'")


class Local(Backend):
    """The model and its pool in this process."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.device = torch.device(
            config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        )
        self.use_device()
        dense = config.weights if config.weights in DENSE else None
        self.dtype = pick_dtype(config.dtype or dense, self.device)
        self.setup()
        loaded = self.load()
        self.model, self.args = loaded.model, loaded.args
        self.pool_args = self.args
        self.tokenizer = loaded.tokenizer
        self.stop_token_ids = loaded.stop_token_ids
        self.profile_name = config.model  # the key of its Cost(l) profile
        if use_gguf(config, self.device, self.dtype):
            gguf = bundle_gguf(config.model, config.cache_dir)
            n = swap_int4(self.model, read_q4(gguf, self.args), self.dtype)
            log.info("weights: %d linears with %s's own 4-bit weights", n, gguf.name)
            self.profile_name = f"{config.model}+int4"
        if config.weights == "float16":
            self.use_fp16()
        if config.pack_cpu_weights:
            pack_linears(self.model)  # CPU layers only; a no-op elsewhere
        self.attention = pick_backend(self.device, config.attention_backend)
        check_kv_dtype(config.kv_dtype, self.attention, self.device)
        self.gpu = self.device.type == "cuda"

    def use_fp16(self) -> None:
        if self.device.type != "cpu" or not fp16.available():
            raise ValueError(
                "weights='float16' runs on the CPU where FBGEMM's float16 linear does "
                f"(device {self.device.type}): on CUDA use dtype='float16'"
            )
        n = fp16.swap_fp16(self.model)
        log.info("weights: %d linears in float16, float32 math", n)
        self.profile_name = f"{self.config.model}+fp16"

    def setup(self) -> None:
        """Before the model loads (tensor parallelism starts its ranks here)."""

    def load(self) -> Loaded:
        c = self.config
        return load(c.model, self.device, self.dtype, c.cache_dir, c.seed)

    def pool(self, gpu_blocks: int, cpu_blocks: int, layout: KVLayout) -> KVPool:
        c = self.config
        return KVPool(
            self.args, gpu_blocks, cpu_blocks, c.chunk_size, self.device, self.dtype, c.kv_dtype,
            layout,
        )  # fmt: skip

    def runner(self, pool: KVPool) -> Runner:
        return Runner(self.model, pool, self.config.chunk_size, self.attention)

    def policy_cost(self, max_context: int) -> CostModel:
        """This model's Cost(l) on this device: its profile, read from the file kept per
        model and device (profiled now, into it, the first time)."""
        c = self.config
        return load_or_profile(
            self.model,
            self.profile_name,
            c.chunk_size,
            max_context,
            self.device,
            self.dtype,
            cache_root(c.cache_dir),
            self.attention,
        )

    def disk(self, cost: CostModel, bytes_per_chunk: int) -> ChunkFiles:
        """Files under `disk_cache_dir`, in a namespace of the model and its KV layout."""
        c, a = self.config, self.args
        layout = KVLayout.of(a, c.window_savings)
        pages = (f"pages {layout.slots}x{layout.groups}",) if layout.windowed else ()
        space = namespace(
            c.model, str(self.dtype), c.kv_dtype, c.chunk_size, a.n_layers, a.n_kv_heads,
            a.head_dim, *pages,
        )  # fmt: skip
        return ChunkFiles(c.disk_cache_dir, int(c.disk_cache_gb * 1e9), space, cost, c.chunk_size)

    @property
    def graphs_enabled(self) -> bool:
        """Steps from CUDA graphs: asked for, on CUDA, with the triton backend, and experts
        (if any) that run without host syncs."""
        c, safe = self.config, graph_safe(self.args.n_experts, self.device, self.dtype)
        return c.cuda_graphs and self.gpu and self.attention == "triton" and safe

    def finish(self, runner: Runner, pool: KVPool, max_context: int, gpu_blocks: int) -> None:
        """The compiled CPU forward and the CUDA graphs, where asked for: they need the pool."""
        c = self.config
        if c.compile_cpu:
            self.compile_cpu(runner, pool)
        if self.graphs_enabled:
            runner.graphs = StepGraphs(
                self.model,
                pool,
                self.attention,
                buckets(
                    min(c.max_running, c.max_batch_tokens),
                    min(c.cuda_graph_tokens, c.max_batch_tokens),
                ),
                width=min(-(-max_context // c.chunk_size), gpu_blocks),
                vocab=self.args.vocab_size,
            )
            runner.graphs.capture()

    def compile_cpu(self, runner: Runner, pool: KVPool) -> None:
        """The forward compiled by Inductor (engine/model/compiled.py), compiled now; where
        it cannot serve (not the CPU, an 8-bit pool), eager."""
        if not usable(self.model, pool.layers):
            log.warning("compile_cpu serves a CPU model over a 16-bit or float32 pool, one rank")
            return
        compiled = CompiledForward(self.model, pool.layers)
        try:
            compiled.warm_up()
            runner.compiled = compiled
        except Exception as e:  # no C++ compiler, an op Inductor cannot lower: any failure
            log.warning("compile_cpu: the forward did not compile (%s); it runs eagerly", e)

    def pin(self, parts: dict) -> dict:
        """On CUDA, page-locked: copied layer by layer, asynchronously."""
        if self.device.type != "cuda":
            return parts
        return {j: [p.pin_memory() for p in ps] for j, ps in parts.items()}

    def use_device(self) -> None:
        """Triton launches, events and graph captures go to the calling thread's current
        device, not to their tensors' (cuda:1 ...)."""
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)
