"""Client settings, validated once at construction (shared by Client and AsyncClient)."""

from __future__ import annotations

import os
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
REDIS_URL_ENV = "TOKENRELAY_REDIS_URL"


def default_redis_url() -> str:
    """``$TOKENRELAY_REDIS_URL`` or the local default; read at call time so tests can set it."""
    return os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL


class ClientConfig(BaseModel):
    """How a producer talks to one queue.

    ``max_queued_jobs`` overrides the queue's shared high-water mark (the ``max_queued_jobs``
    field of the queue's config hash); None uses the shared one, 0 disables back-pressure.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    redis_url: str = Field(default_factory=default_redis_url)
    queue: str = "default"
    namespace: str = "tokenrelay"
    max_queued_jobs: Optional[int] = Field(default=None, ge=0)
    dedupe_ttl_s: int = Field(default=86_400, ge=1)
    cancel_ttl_s: int = Field(default=86_400, ge=1)
    connect_timeout_s: float = Field(default=2.0, gt=0)
    socket_timeout_s: float = Field(default=10.0, gt=0)
    reconnect_timeout_s: float = Field(default=30.0, ge=0)
    poll_ms: int = Field(default=2_000, ge=10, description="longest XREAD BLOCK")
    chunk_size: int = Field(default=500, ge=1, le=10_000, description="jobs per enqueue script call")
    pipeline_depth: int = Field(default=4, ge=1, description="script calls in flight per round trip")
    affinity_max_backlog: int = Field(
        default=128, ge=1, description="a job with a routing_key goes to the shared lanes when "
        "its worker holds this many jobs and unread affinity jobs (producer_sdk/affinity.py)")
    affinity_ttl_s: float = Field(default=1.0, ge=0, description="seconds the live workers read "
                                  "for affinity routing are reused")

    @model_validator(mode="after")
    def _socket_outlives_block(self) -> "ClientConfig":
        if self.socket_timeout_s * 1000 <= self.poll_ms + 500:
            raise ValueError(f"socket_timeout_s ({self.socket_timeout_s}) must exceed poll_ms "
                             f"({self.poll_ms} ms) by at least 0.5 s, or blocking reads time out")
        return self
