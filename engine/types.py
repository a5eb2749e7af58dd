"""Public value types of the engine API: configuration, sampling, turns and their results."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal


class CacheMode(StrEnum):
    """What is kept across turns."""

    PENSIEVE = "pensieve"  # the GPU and CPU tiers (and the disk tier where configured)
    GPU = "gpu"  # the GPU tier only: evicted chunks are dropped
    STATELESS = "stateless"  # nothing: every turn computes its whole context again


class Eviction(StrEnum):
    """The order chunks leave a tier in (engine/cache/policy.py)."""

    PENSIEVE = "pensieve"  # Cost(l) / T: recompute cost over idle time
    RETURNS = "returns"  # Cost(l) times the learned chance the conversation comes back
    LRU = "lru"


CACHE_MODES = tuple(m.value for m in CacheMode)
EVICTION_POLICIES = tuple(m.value for m in Eviction)
KV_DTYPES = ("auto", "fp8", "int8")  # auto: the model's dtype
# gguf: a GGUF's own 4-bit linears (engine/model/int4.py); bfloat16 / float32: dequantized;
# float16: float16 linear weights, float32 math (CPU, engine/model/fp16.py)
WEIGHTS = ("auto", "gguf", "bfloat16", "float32", "float16")
DENSE = ("bfloat16", "float32")


@dataclass
class EngineConfig:
    model: str = "smollm2-135m-instruct"
    device: str | None = None  # None: "cuda" when present, else "cpu"
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    kv_dtype: str = "auto"  # "fp8" (e4m3) or "int8": 8-bit KV, ~2x the chunks per byte
    # "gguf": a bundled GGUF's 4-bit linears as stored, on the CPU (engine/model/int4.py);
    # "bfloat16" / "float32": dequantized, in that dtype (dtype must agree); "float16": the
    # linears' weights in float16, their math and the rest float32 (CPU; dtype float32);
    # "auto": the 4-bit ones only where they are faster (engine/backends/local.py, `use_gguf`)
    weights: str = "auto"
    kv_events: bool = False  # record where chunks live for a fleet's routers (`kv_events()`)
    chunk_size: int = 32
    gpu_cache_chunks: int | None = None  # None: sized from free memory
    cpu_cache_chunks: int | None = None  # None: sized from host memory
    cache_mode: CacheMode = CacheMode.PENSIEVE  # a plain string is taken too
    eviction: Eviction = Eviction.PENSIEVE
    max_batch_tokens: int = 2048
    max_running: int = 256  # most turns decoding at once
    max_waiting: int = 256  # most turns queued for admission (AsyncEngine refuses more)
    swap_out_threshold: float = 0.25  # ahead-of-time swap-out when free GPU blocks fall under this
    admit_reserve: float = 0.10  # admit new turns only while this share of GPU blocks stays free
    # Share of a step's token budget that a recompute prefetch (typing) may take while real
    # turns run. None: 0.25 on CUDA, where a decode step's spare tokens are nearly free, and
    # 0 elsewhere, where every token costs its compute (prefetch then recomputes only in
    # steps without real turns)
    prefetch_share: float | None = None
    # Most tokens a recompute prefetch computes in one step. None: the whole budget on CUDA,
    # 4 chunks elsewhere: a step cannot be cut short, and a turn that arrives during a long
    # CPU step of prefetch alone waits for all of it
    prefetch_step_tokens: int | None = None
    unified: bool = True  # False: prompt steps and decode steps never share a batch
    seed: int = 0  # seeds dummy weights
    cache_dir: str | None = None  # converted models and cost profiles; None: ~/.cache/pensieve
    attention_backend: str | None = None  # None: Triton on CUDA, torch elsewhere
    pack_cpu_weights: bool = True  # CPU: oneDNN-packed float32 / bfloat16 linears (faster decode)
    # CPU: the forward compiled by Inductor into one graph for every batch shape (about 50 s
    # at start for the bundled model on 2 cores; engine/model/compiled.py)
    compile_cpu: bool = False
    # pensieve mode: full chunks of first prompts that are equal across conversations (a
    # system prompt) are stored once and linked by new conversations instead of computed
    share_prefixes: bool = True
    # A model with sliding and full layers (Gemma 3, gpt-oss) keeps a chunk's sliding layers'
    # KV only while it is inside their window (engine/kv_layout.py); off: every layer's, as a
    # model without a window (shared prefixes need it off)
    window_savings: bool = True
    # A conversation waiting for a tool's result is held in memory (as a client's pin holds
    # it: never dropped, admission waits) for the 90th percentile of the tool gaps seen. Off
    # by default: it saves a third of agents' recompute where memory is short, and chats
    # queue behind the holds there (bench/README.md, "Agents")
    tool_holds: bool = False
    # A conversation waiting for a tool's result is worth Cost over the tool's expected wait
    # still to come (engine/cache/toolwait.py). Off: tool calls order jobs only (benchmarks
    # compare the value with other retention policies on the same scheduler)
    tool_value: bool = True
    # Waiting turns are admitted by job: a turn that carries a tool's result ranks with the
    # turn that began its agent loop (engine/scheduler.py). Agents finish sooner under memory
    # pressure; a chat turn may wait behind the steps of agents begun before it came
    # (bench/README.md, "Agents"). Off: by arrival alone
    job_order: bool = True
    # Ranks the model is split across (heads, KV heads, MLP, vocabulary): worker processes
    # over torch.distributed, one GPU each on CUDA; 1: no workers, one process as before
    tensor_parallel: int = 1
    # Run the tensor-parallel path even at tensor_parallel=1: a process group of one rank (NCCL
    # on CUDA), the sharded layers with their collectives, the step messages, ParallelPool.
    # For testing and measuring that path where there is one GPU; off: one plain process.
    force_tensor_parallel: bool = False
    # Steps without a swap-in replay CUDA graphs captured per bucket of positions and turns
    # (engine/graphs.py): decode steps up to 256 turns, and mixed prompt and decode steps up to
    # `cuda_graph_tokens` positions (0: decode steps only); effective on CUDA with the triton
    # backend and one rank only
    cuda_graphs: bool = True
    # The host runs a step ahead of the device: it plans and launches step N, then reads step
    # N-1's tokens while N runs (engine/engine.py). None: on for CUDA, off elsewhere (on the
    # CPU nothing runs while the host plans); a tensor-parallel or simulated engine stays in step
    async_steps: bool | None = None
    cuda_graph_tokens: int = 512
    # pensieve mode: a third tier of files under this directory (None: off). Chunks the CPU
    # tier drops are written there behind the step loop and read back instead of recomputed
    # where that is cheaper, also after a restart and on another replica sharing the directory
    disk_cache_dir: str | None = None
    disk_cache_gb: float = 10.0  # the disk tier's size; files of lowest value go first

    def prefetch_limits(self, gpu: bool) -> tuple[float, int]:
        """`prefetch_share` and `prefetch_step_tokens`, their defaults for a GPU or not."""
        share = self.prefetch_share
        if share is None:
            share = 0.25 if gpu else 0.0
        quantum = self.prefetch_step_tokens
        if quantum is None:
            quantum = self.max_batch_tokens if gpu else 4 * self.chunk_size
        return share, quantum

    def validate(self) -> None:
        if self.cache_mode not in CACHE_MODES:
            raise ValueError(f"cache_mode must be one of {CACHE_MODES}, got {self.cache_mode!r}")
        self.cache_mode = CacheMode(self.cache_mode)
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {self.weights!r}")
        if self.weights in DENSE and self.dtype not in (None, self.weights):
            raise ValueError(
                f"weights={self.weights!r} (dequantized) needs dtype {self.weights!r} or none, "
                f"got dtype={self.dtype!r}"
            )
        if self.weights == "float16" and self.dtype not in (None, "float32"):
            raise ValueError(
                f"weights='float16' computes in float32: dtype float32 or none, not {self.dtype!r}"
            )
        if self.weights in ("gguf", "float16") and (
            self.tensor_parallel > 1 or self.force_tensor_parallel
        ):
            raise ValueError(
                f"weights={self.weights!r} serves one process: not with tensor parallelism"
            )
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {EVICTION_POLICIES}, got {self.eviction!r}")
        self.eviction = Eviction(self.eviction)
        if self.chunk_size < 1 or self.chunk_size & (self.chunk_size - 1):
            raise ValueError(f"chunk_size must be a power of two, got {self.chunk_size}")
        if self.max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be positive")
        if self.max_running < 1 or self.max_waiting < 1:
            raise ValueError("max_running and max_waiting must be positive")
        if self.cuda_graph_tokens < 0:
            raise ValueError(
                f"cuda_graph_tokens must not be negative, got {self.cuda_graph_tokens}"
            )
        if self.gpu_cache_chunks is not None and self.gpu_cache_chunks < 1:
            raise ValueError("gpu_cache_chunks must be positive")
        if self.cpu_cache_chunks is not None and self.cpu_cache_chunks < 0:
            raise ValueError("cpu_cache_chunks must not be negative")
        if not isinstance(self.tensor_parallel, int) or self.tensor_parallel < 1:
            raise ValueError(
                f"tensor_parallel must be a positive integer, got {self.tensor_parallel!r}"
            )
        if not 0.0 <= self.admit_reserve < 1.0 or not 0.0 <= self.swap_out_threshold < 1.0:
            raise ValueError("admit_reserve and swap_out_threshold must be in [0, 1)")
        if self.disk_cache_gb <= 0:
            raise ValueError(f"disk_cache_gb must be positive, got {self.disk_cache_gb!r}")
        if self.disk_cache_dir and (self.tensor_parallel > 1 or self.force_tensor_parallel):
            raise ValueError("the disk tier does not work with tensor parallelism yet")
        if self.prefetch_share is not None and not 0.0 <= self.prefetch_share <= 1.0:
            raise ValueError(f"prefetch_share must be in [0, 1], got {self.prefetch_share!r}")
        if self.prefetch_step_tokens is not None and self.prefetch_step_tokens < 1:
            raise ValueError("prefetch_step_tokens must be positive")


@dataclass(frozen=True)
class Guide:
    """Constrained decoding: the reply must match this grammar (token masks in the sampler)."""

    kind: Literal["json_schema", "json_object", "lark", "regex"]
    source: str = ""  # the JSON schema as JSON text, the Lark grammar or the regex


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    ignore_eos: bool = False  # benchmarks: always generate max_tokens
    stop_token_ids: tuple[int, ...] = ()  # extra stop tokens beside the model's own
    min_tokens: int = 0  # no stop token before this many tokens
    guide: Guide | None = None

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")


@dataclass
class Retention:
    """What a turn asks the cache to keep of its conversation once it ends.

    `ttl_s`: its chunks stay in memory (GPU or CPU tier, never dropped) this long after the
    turn ends, refreshed by each later turn; 0 says the session is done (its chunks go
    first). `priority` (0-100, 50 neutral) scales its eviction value. `disk_s`: its full
    chunks stay on the disk tier at least this long. The pin counts against `owner`'s
    `cap_bytes` (None: no cap): a pin past the cap is refused, never made room for."""

    ttl_s: float | None = None
    priority: int = 50
    disk_s: float = 0.0
    owner: str = ""
    cap_bytes: int | None = None

    def validate(self) -> None:
        if self.ttl_s is not None and not 0.0 <= self.ttl_s <= MAX_TTL_S:
            raise ValueError(f"retention.ttl_s must be in [0, {MAX_TTL_S:.0f}], got {self.ttl_s!r}")
        if not isinstance(self.priority, int) or not 0 <= self.priority <= 100:
            raise ValueError(f"retention.priority must be in [0, 100], got {self.priority!r}")
        if self.disk_s < 0:
            raise ValueError(f"retention.disk_s must not be negative, got {self.disk_s!r}")


MAX_TTL_S = 86_400.0  # a pin in memory lasts at most a day after its turn


@dataclass
class Turn:
    """One user turn: only the tokens that extend the conversation's stream.

    `context_len` is how many tokens the conversation held before this prompt, as the
    caller's durable history knows it. None: the engine's own count (0 for a new id).
    A server passes it so that, after a restart, the engine knows the context it must
    recompute from the history store.
    """

    conversation_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    context_len: int | None = None
    retention: Retention | None = None  # None: the eviction value alone decides

    def validate(self, vocab_size: int) -> None:
        if not isinstance(self.conversation_id, str) or not self.conversation_id:
            raise ValueError("conversation_id must be a non-empty string")
        if not self.prompt_token_ids:
            raise ValueError("the prompt is empty: a turn needs at least one new token")
        ids = self.prompt_token_ids
        if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
        self.sampling.validate()
        if self.sampling.guide is not None and self.sampling.ignore_eos:
            raise ValueError("a guided turn ends when its grammar does: no ignore_eos")
        if self.context_len is not None and (
            not isinstance(self.context_len, int) or self.context_len < 0
        ):
            raise ValueError("context_len must be a non-negative integer")
        if self.retention is not None:
            self.retention.validate()


@dataclass
class TurnStats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # context found on the GPU tier
    swapped_in_tokens: int = 0  # context brought back from the CPU tier
    recomputed_tokens: int = 0  # context recomputed from raw history
    shared_tokens: int = 0  # prompt tokens found in chunks shared with other conversations
    disk_tokens: int = 0  # context read back from the disk tier
    prefetched_tokens: int = 0  # of the context on the GPU: what a prefetch brought back
    arrival_s: float = 0.0
    admitted_s: float = 0.0  # first scheduled: arrival_s to here is time spent queued
    first_token_s: float = 0.0
    finish_s: float = 0.0
    suspensions: int = 0

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.arrival_s


class FinishReason(StrEnum):
    """Why a turn ended: its result's `finish_reason` (the value, a plain string)."""

    STOP = "stop"  # it sampled a stop token
    LENGTH = "length"  # max_tokens, the model's window, or the whole GPU tier reached
    CANCELLED = "cancelled"
    ERROR = "error"  # its history read, or a step, failed


@dataclass
class TurnResult:
    conversation_id: str
    token_ids: list[int]
    finish_reason: str  # a FinishReason's value: "stop" | "length" | "cancelled" | "error"
    stats: TurnStats
