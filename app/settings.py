"""Server settings: `pensieve serve` flags over PENSIEVE_* environment variables over defaults.

The engine's settings are `EngineConfig`'s fields, taken from the dataclass itself: a field
added there is a setting (PENSIEVE_<NAME>) and a `pensieve serve --<name>` flag at once, with
the help text below.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Annotated, Any

from pydantic import Field, create_model, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from engine.types import EngineConfig

# One line of help per EngineConfig field (tests check that none is missing).
ENGINE_HELP: dict[str, str] = {
    "model": "a bundled model (smollm2-135m-instruct; gemma-3-270m with the extra gemma), a Hugging "
    "Face model dir or hub id (org/name), or dummy:<shape>",
    "device": "cpu or cuda (default: cuda when present)",
    "dtype": "float32, bfloat16, float16 (default: bfloat16 on CUDA and on CPUs with native "
    "bfloat16 when served, else float32)",
    "kv_dtype": "KV cache: auto (the model dtype), fp8 (e4m3) or int8 (8-bit: ~2x the chunks)",
    "weights": "auto | gguf (a bundled GGUF's own 4-bit weights, CPU) | bfloat16 | float32 "
    "(dequantized; dtype must agree) | float16 (CPU: float16 linear weights, float32 math). "
    "auto: dequantized; served on a CPU without native bfloat16, float16 (4-bit is opt-in: it "
    "halves the weights' memory but is no faster at 8 rows, slower at 16)",
    "chunk_size": "tokens per KV chunk (a power of two)",
    "gpu_cache_chunks": "GPU KV cache size in chunks (default: from free memory)",
    "cpu_cache_chunks": "CPU KV cache size in chunks (default: from host memory)",
    "cache_mode": "pensieve | gpu | stateless",
    "eviction": "pensieve (Cost/T) | returns (Cost x learned chance of a return) | lru",
    "max_batch_tokens": "token budget of one step",
    "max_running": "most turns decoding at once",
    "max_waiting": "most turns queued for the engine; more are refused as busy",
    "swap_out_threshold": "swap chunks out ahead of time once free GPU blocks fall under this share",
    "admit_reserve": "admit new turns only while this share of GPU blocks stays free",
    "prefetch_share": "share of a step's tokens a typing prefetch may take while real turns run "
    "(default: 0.25 on CUDA, 0 on the CPU)",
    "prefetch_step_tokens": "most tokens a typing prefetch computes in one step (default: the "
    "whole budget on CUDA, 4 chunks on the CPU)",
    "unified": "prompt and decode steps share a batch",
    "seed": "seed of dummy weights",
    "cache_dir": "converted models and cost profiles (default: ~/.cache/pensieve)",
    "attention_backend": "attention implementation (default: Triton on CUDA, torch elsewhere)",
    "pack_cpu_weights": "CPU: oneDNN-packed float32 and bfloat16 linears",
    "compile_cpu": "CPU: compile the forward with torch.compile at start (faster steps)",
    "share_prefixes": "pensieve mode: store chunks of first prompts equal across conversations "
    "(a system prompt) once, and link them instead of computing them",
    "window_savings": "models with sliding and full layers (Gemma 3, gpt-oss) keep a chunk's "
    "sliding layers' KV only while it is inside their window (off: every layer's; shared "
    "prefixes need it off)",
    "tool_holds": "hold a conversation waiting for a tool's result in memory for the 90th "
    "percentile of the tool gaps seen (saves recompute where memory is short; chats queue "
    "behind the holds there)",
    "tool_value": "value a conversation waiting for a tool's result by the tool's expected "
    "wait still to come (off: tool calls order jobs only)",
    "job_order": "admit a turn that carries a tool's result with the turn that began its "
    "agent loop, ahead of turns that came after (off: by arrival alone)",
    "cuda_graphs": "replay steps without a swap-in from CUDA graphs captured per bucket of "
    "positions and turns (CUDA with the triton backend, one rank)",
    "cuda_graph_tokens": "largest mixed prompt and decode step replayed from a CUDA graph, in "
    "positions (0: decode steps only)",
    "async_steps": "plan and launch each step before reading the previous one's tokens, so "
    "the device does not wait for the host (default: on for CUDA, off elsewhere)",
    "tensor_parallel": "split the model across this many ranks (GPUs on CUDA): worker processes "
    "over torch.distributed; heads must divide by it",
    "force_tensor_parallel": "run the tensor-parallel path even at tensor_parallel=1 (a one-rank "
    "process group, collectives, step messages): to test it on one GPU",
    "disk_cache_dir": "a third KV tier of files under this directory (off when unset): chunks "
    "the CPU tier drops are kept there, read back after restarts and on replicas sharing it",
    "disk_cache_gb": "size of the disk tier in GB",
}


SET_BY_SERVER = ("kv_events",)  # engine fields that follow a server setting, not flags


def engine_fields() -> list[tuple[str, Any, Any]]:
    """(name, type, default) of each EngineConfig field a server setting sets directly."""
    hints = typing.get_type_hints(EngineConfig)
    out = []
    for f in dataclasses.fields(EngineConfig):
        if f.name in SET_BY_SERVER:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        out.append((f.name, hints[f.name], default))
    return out


ZMQ_ENDPOINT = r"^(tcp|ipc)://\S+$"


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PENSIEVE_", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    database_url: str = "sqlite+aiosqlite:///./data/pensieve.db"
    # Connect, statement and pool-checkout bound of each database operation.
    database_timeout_s: float = Field(5.0, gt=0)
    redis_url: str | None = None
    # Replicas: join the directory in Redis (needs redis_url); an id and a URL other
    # replicas reach this one at (default host:port and http://host:port).
    cluster: bool = False
    replica_id: str | None = Field(None, min_length=1, max_length=200, pattern=r"^[^\s]+$")
    replica_url: str | None = Field(None, pattern=r"^https?://[^\s/]+/?$")
    # None: the token in admin_token_file is used, made there (mode 0600) on first start.
    admin_token: str | None = None
    admin_token_file: str = "./data/admin-token"
    allowed_origins: Annotated[
        list[str], NoDecode
    ] = []  # browser origins accepted beside the server's own (WebSocket and REST)

    max_message_chars: int = Field(16_000, ge=1)
    max_tokens_default: int = Field(512, ge=1)
    max_tokens_limit: int = Field(2048, ge=1)
    system_prompt: str | None = None  # default for new chats; None: the model template's own
    cookie_secure: bool = False  # mark cookies Secure (set behind HTTPS)
    # A Jinja chat template file to use instead of the model's own (as vLLM's --chat-template)
    chat_template: str | None = None
    # A reply the template renders differently in history (a thinking model's, without its
    # thinking) is re-encoded that way when it ends, so the next turn reuses the history
    reencode_replies: bool = True

    max_body_bytes: int = Field(64 * 1024, ge=1)  # largest REST request body
    # Largest /v1 request body: OpenAI clients resend the whole chat every turn.
    max_api_body_bytes: int = Field(4 * 1024 * 1024, ge=1)
    max_chats_per_owner: int = Field(1000, ge=1)
    # Browser owners made per client address and minute (each cookieless page visit makes one).
    new_users_per_minute: int = Field(10, ge=1)
    turns_per_minute: int = Field(30, ge=1)  # messages one owner may send a minute, all chats
    # A chat socket that goes away mid-reply: the reply goes on this long for the client to
    # reconnect and resume it; then it is cancelled (its partial reply kept). 0: at once.
    resume_grace_s: float = Field(10.0, ge=0)
    # KV one owner may pin in memory (`retention.ttl_s`), in MB: a pin past it is refused
    max_pinned_mb_per_owner: float = Field(1024.0, gt=0)
    # KV events for a fleet's prefix routers (Dynamo, vllm-router, llm-d; app/kv_events.py):
    # a ZMQ endpoint to publish on, one to replay recent batches on, and the frames' topic
    kv_events_endpoint: str | None = Field(None, pattern=ZMQ_ENDPOINT)
    kv_events_replay_endpoint: str | None = Field(None, pattern=ZMQ_ENDPOINT)
    kv_events_topic: str = Field("", max_length=200)

    @field_validator("allowed_origins", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        # PENSIEVE_ALLOWED_ORIGINS may be a comma-separated list as well as JSON.
        if isinstance(value, str):
            value = json.loads(value) if value.lstrip().startswith("[") else value.split(",")
        if isinstance(value, list):
            return [str(v).strip().rstrip("/") for v in value if str(v).strip()]
        return value

    @model_validator(mode="after")
    def _cluster_needs_redis(self):
        if self.cluster and not self.redis_url:
            raise ValueError("cluster: a replica needs redis_url (the shared directory)")
        return self

    @model_validator(mode="after")
    def _replay_needs_events(self):
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint: needs kv_events_endpoint")
        return self

    @model_validator(mode="after")
    def _engine_valid(self):
        self.engine_config()  # a bad engine setting fails here, before anything starts
        return self

    def engine_config(self) -> EngineConfig:
        names = [f.name for f in dataclasses.fields(EngineConfig) if f.name not in SET_BY_SERVER]
        config = EngineConfig(
            **{name: getattr(self, name) for name in names},
            kv_events=self.kv_events_endpoint is not None,
        )
        config.validate()
        return config


Settings = create_model(
    "Settings",
    __base__=ServerSettings,
    __doc__="ServerSettings plus one field per EngineConfig field.",
    **{
        name: (kind, Field(default, description=ENGINE_HELP.get(name)))
        for name, kind, default in engine_fields()
    },
)
