"""The gateway's settings: one pydantic-settings model, so every flag is also a variable.

``tokenrelay gateway --port 8000`` and ``TOKENRELAY_PORT=8000`` are the same setting
(``protocol/settings.py`` generates the flags from these fields, as for every tokenrelay
command). The connection fields are ConnectionSettings' own, not copies, so
``TOKENRELAY_REDIS_URL`` and ``TOKENRELAY_NAMESPACE`` mean what they mean for the worker. There
is no ``--queue``: the gateway routes each request to the queue whose workers serve its model.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator

from tokenrelay.protocol.settings import BackPressureSettings, ConnectionSettings, key_part, unset
from tokenrelay.protocol.keys import MAX_SHARDS

_CONN = ConnectionSettings.model_fields


class GatewaySettings(BackPressureSettings):
    """Options of ``tokenrelay gateway`` (``--max-queued-jobs`` and
    ``--max-queued-tokens`` bound every queue it sends to, over the queues' own)."""

    redis_url: str = _CONN["redis_url"]
    cluster: Literal["auto", "on", "off"] = _CONN["cluster"]
    namespace: str = _CONN["namespace"]
    shards: Optional[int] = Field(
        None, ge=1, le=MAX_SHARDS, description="Shard count of every queue the gateway sends "
        "to (one that registered another is refused).",
        json_schema_extra=unset("each queue's registered count, else 1"))
    host: str = Field("127.0.0.1", description="Address to listen on (0.0.0.0 in a container).")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to listen on.")
    api_keys: list[str] = Field(
        [], description="Bearer keys, each 'KEY' or 'KEY PRIORITY' (its lane: <0 urgent, 0 default, "
                    ">0 bulk); none and no --api-keys-file: no auth.")
    api_keys_file: Optional[str] = Field(
        None, description="File of bearer keys, one 'KEY [PRIORITY]' a line, # comments.",
        json_schema_extra=unset("no key file"))
    default_priority: int = Field(0, description="Priority of requests whose key names none.")
    routes: list[str] = Field(
        [], description="'MODEL=QUEUE' routes known even while no worker of theirs is live (503, "
                    "not 404); live workers' heartbeats add the rest.")
    deadline_s: float = Field(600.0, gt=0, description="Seconds a request may wait in its "
                              "queue before it starts (504 after); X-Request-Timeout lowers it.")
    request_timeout_s: Optional[float] = Field(
        None, gt=0, description="Seconds a request may take in total (504 after, its job "
        "cancelled); X-Request-Timeout sets it per request.",
        json_schema_extra=unset("no limit but the start deadline"))
    wait_for_worker: bool = Field(False, description="Enqueue requests for a known model with "
                                  "no live worker and wait (within the deadline) instead of "
                                  "answering 503 no_live_worker; X-Wait-For-Worker sets it per "
                                  "request.")
    max_in_flight: int = Field(4096, ge=1, description="Generation requests answered at once, "
                               "counted once their body arrived; past it 429 with Retry-After.")
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="Largest request body; "
                                "a bigger one is refused (413) before it is read whole.")
    header_timeout_s: float = Field(10.0, gt=0, description="Seconds a client may take to send "
                                    "a request's headers (a connection idle that long is "
                                    "closed).")
    body_timeout_s: float = Field(30.0, gt=0, description="Most seconds a client may take to "
                                  "send a request's body (408 after); also the deadline of a "
                                  "body of no declared length.")
    body_grace_s: float = Field(1.0, gt=0, description="Seconds a body may take before it is a "
                                "slow body (bounded by --max-slow-bodies and --body-min-rate).")
    max_slow_bodies: int = Field(256, ge=1, description="Slow bodies read at once; past it 429. "
                                 "They do not count against --max-in-flight.")
    body_min_rate: int = Field(4096, ge=1, description="Bytes per second a slow body must "
                               "average: its deadline is --body-grace-s plus its Content-Length "
                               "at this rate (--body-timeout-s at most).")
    redis_max_connections: int = Field(64, ge=4, description="Redis connections of the pool "
                                       "(per node of a cluster); a command waits for a free one.")
    redis_pool_timeout_s: float = Field(5.0, gt=0, description="Longest wait for a free Redis "
                                        "connection (503 after).")
    redis_retry_s: float = Field(30.0, ge=0, description="Seconds result reads, cancels and "
                                 "status reads keep retrying a lost connection or a cluster "
                                 "failover before a request gives up (its job cancelled).")
    reader_streams: int = Field(256, ge=1, le=10_000, description="Result streams one shared "
                                "reader reads (one blocking XREAD each).")
    reader_wake: bool = Field(True, description="Wake a shared reader's blocked XREAD when a "
                              "request joins it (a private wake stream); off: readers block in "
                              "50 ms slices.")
    keepalive_s: float = Field(10.0, gt=0, description="Seconds between ': keep-alive' SSE "
                               "comments while a stream has nothing to send.")
    resume_grace_s: float = Field(5.0, ge=0, le=3600, description="Seconds a streamed job "
                                  "outlives its client's disconnect, waiting for a resume with "
                                  "Last-Event-ID (on any gateway of the namespace); then it is "
                                  "cancelled. 0: cancelled at once.")
    resume_ttl_s: float = Field(3600.0, gt=0, description="Seconds a stream's resume record "
                                "is kept, from the stream's start and again from its end or "
                                "its client's disconnect: an ended stream can be resumed that "
                                "long, while its result stream lasts (the workers' "
                                "--result-ttl).")
    status_wait_s: float = Field(2.0, ge=0, description="Seconds a stream waits for its first "
                                 "token before it sends its headers: an error by then (an "
                                 "expired deadline) gets its HTTP status, a later one an SSE "
                                 "error event.")
    retry_after_s: int = Field(1, ge=0, description="Retry-After of a 429 (queue full, too many "
                               "requests) and a 503 (Redis unreachable).")
    models_refresh_s: float = Field(1.0, ge=0, description="Seconds the model list read from "
                                    "worker heartbeats is reused.")
    tokenize_timeout_s: float = Field(10.0, gt=0, description="Seconds /tokenize and "
                                      "/detokenize wait for a worker of the model to answer "
                                      "(504 after).")
    log_level: str = Field("info", description="uvicorn log level: debug, info, warning, error.")

    _key_parts = field_validator("namespace")(key_part)
