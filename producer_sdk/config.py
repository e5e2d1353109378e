"""Client settings, validated once at construction (shared by Client and AsyncClient)."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tokenrelay.protocol.keys import MAX_SHARDS
from tokenrelay.protocol.settings import default_cluster, default_redis_url, default_shards
from tokenrelay.protocol.wire import PRODUCER_PATTERN



class ClientConfig(BaseModel):
    """How a producer talks to one queue.

    ``max_queued_jobs`` overrides the queue's shared high-water mark (the ``max_queued_jobs``
    field of the queue's config hash); None uses the shared one, 0 disables back-pressure.
    ``max_queued_tokens`` does the same for the queue's token budget (``max_queued_tokens``).
    ``cluster``: None asks the server whether it is a Redis Cluster node (any node's URL
    works), True/False force it (also ``auto``/``on``/``off``, ``$TOKENRELAY_CLUSTER``).
    ``shards``: the queue's shard count; None uses the count its workers registered (else 1),
    and a count that differs from the registered one is refused (``ShardCountMismatch``).
    ``durable``: every submit waits until ``durable_replicas`` replicas acknowledged its
    writes (``WAIT``, at most ``durable_timeout_ms``), else raises NotDurable; a submit's
    own ``durable=`` overrides it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    redis_url: str = Field(default_factory=default_redis_url)
    queue: str = "default"
    namespace: str = "tokenrelay"
    max_queued_jobs: Optional[int] = Field(default=None, ge=0)
    max_queued_tokens: Optional[int] = Field(
        default=None, ge=0, description="the queue's token budget (protocol/budget.py): None "
        "uses the config hash's max_queued_tokens (absent: none), 0 disables it")
    context_tokens: int = Field(
        default=8192, ge=1, description="the context a chat job without max_tokens is costed "
        "at for the token budget: set it to the workers' max_model_len")
    dedupe_ttl_s: int = Field(default=86_400, ge=1)
    cancel_ttl_s: int = Field(default=86_400, ge=1)
    connect_timeout_s: float = Field(default=2.0, gt=0)
    socket_timeout_s: float = Field(default=10.0, gt=0)
    reconnect_timeout_s: float = Field(default=30.0, ge=0)
    poll_ms: int = Field(default=2_000, ge=10, description="longest XREAD BLOCK")
    max_connections: int = Field(default=64, ge=2, description="asyncio clients: connections "
                                 "of the pool (per node of a cluster); a command waits for a "
                                 "free one up to pool_timeout_s")
    pool_timeout_s: float = Field(default=5.0, gt=0, description="asyncio clients: longest "
                                  "wait for a free pooled connection")
    reader_streams: int = Field(default=256, ge=1, le=10_000, description="asyncio clients: "
                                "result streams one shared reader's XREAD reads at most")
    reader_wake: bool = Field(default=True, description="asyncio clients: a job joining a "
                              "shared reader wakes its blocked XREAD through a private wake "
                              "stream (else the reader blocks in slices of 50 ms)")
    lost_check_s: float = Field(default=2.0, gt=0, description="seconds a waited-for job may "
                                "be idle before its records are checked (a Redis that lost "
                                "them: the job is enqueued again, or ends job_lost)")
    deadline_grace_s: float = Field(default=0.5, ge=0, description="seconds past a job's start "
                                    "deadline before a reader cancels it and ends it expired "
                                    "itself (a worker that reads it first writes expired)")
    chunk_size: int = Field(default=500, ge=1, le=10_000, description="jobs per enqueue script call")
    cluster: Optional[bool] = Field(default_factory=default_cluster, validate_default=True,
                                    description="Redis Cluster: None detects, True/False force")
    shards: Optional[int] = Field(default_factory=default_shards, validate_default=True, ge=1,
                                  le=MAX_SHARDS,
                                  description="the queue's shard count; None: the registered one")
    durable: bool = Field(default=False, description="submits wait for replicas by default")
    durable_replicas: int = Field(default=1, ge=1, description="replicas a durable submit waits for")
    durable_timeout_ms: int = Field(default=1_000, ge=1, description="longest WAIT of a durable submit")
    affinity_max_backlog: int = Field(
        default=128, ge=1, description="a job with a routing_key goes to the shared lanes when "
        "its worker holds this many jobs and unread affinity jobs (producer_sdk/core/affinity.py)")
    affinity_ttl_s: float = Field(default=1.0, ge=0, description="seconds the live workers read "
                                  "for affinity routing are reused")
    producer: Optional[str] = Field(default=None, pattern=PRODUCER_PATTERN, description="the "
                                    "producer id every job of this client carries unless its "
                                    "submit names another: workers share their grammar "
                                    "compile threads fairly among producers")

    @field_validator("cluster", mode="before")
    @classmethod
    def _cluster_mode(cls, value: Any) -> Optional[bool]:
        from tokenrelay.protocol.topology import cluster_flag
        return cluster_flag(value)

    @model_validator(mode="after")
    def _socket_outlives_block(self) -> "ClientConfig":
        longest = max(self.poll_ms, self.durable_timeout_ms)
        if self.socket_timeout_s * 1000 <= longest + 500:
            raise ValueError(f"socket_timeout_s ({self.socket_timeout_s}) must exceed poll_ms "
                             f"and durable_timeout_ms ({longest} ms) by at least 0.5 s, or "
                             f"blocking reads time out")
        return self
