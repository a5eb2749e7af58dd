"""Server settings: `pensieve serve` flags over PENSIEVE_* environment variables over defaults."""

from __future__ import annotations

import json
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PENSIEVE_", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    database_url: str = "sqlite+aiosqlite:///./data/pensieve.db"
    redis_url: str | None = None
    admin_token: str | None = None  # None: a random one is made at start and logged
    allowed_origins: Annotated[
        list[str], NoDecode
    ] = []  # WebSocket origins accepted beside the server's own

    model: str = "smollm2-135m-instruct"
    device: str | None = None
    dtype: str | None = None
    chunk_size: int = 32
    gpu_cache_chunks: int | None = None
    cpu_cache_chunks: int | None = None
    cache_mode: str = "pensieve"
    eviction: str = "pensieve"
    max_batch_tokens: int = 2048
    cache_dir: str | None = None

    max_message_chars: int = Field(16_000, ge=1)
    max_tokens_default: int = Field(512, ge=1)
    max_tokens_limit: int = Field(2048, ge=1)
    system_prompt: str | None = None  # default for new chats; None: the model template's own
    cookie_secure: bool = False  # mark the owner cookie Secure (set behind HTTPS)

    @field_validator("allowed_origins", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        # PENSIEVE_ALLOWED_ORIGINS may be a comma-separated list as well as JSON.
        if isinstance(value, str):
            value = json.loads(value) if value.lstrip().startswith("[") else value.split(",")
        if isinstance(value, list):
            return [str(v).strip().rstrip("/") for v in value if str(v).strip()]
        return value

    def engine_config(self):
        from engine.types import EngineConfig  # imports torch: not for `pensieve users`

        config = EngineConfig(
            model=self.model,
            device=self.device,
            dtype=self.dtype,
            chunk_size=self.chunk_size,
            gpu_cache_chunks=self.gpu_cache_chunks,
            cpu_cache_chunks=self.cpu_cache_chunks,
            cache_mode=self.cache_mode,
            eviction=self.eviction,
            max_batch_tokens=self.max_batch_tokens,
            cache_dir=self.cache_dir,
        )
        config.validate()
        return config

    # chat socket limits
    turns_per_minute: int = Field(30, ge=1)  # messages one owner may send a minute, all chats
