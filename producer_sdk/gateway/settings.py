"""The gateway's settings: one pydantic-settings model, so every flag is also a variable.

``python -m producer_sdk.gateway --port 8000`` and ``TOKENRELAY_PORT=8000`` are the same setting
(``protocol/settings.py`` generates the flags from these fields, as for every tokenrelay
command). The connection fields are ConnectionSettings' own, not copies, so
``TOKENRELAY_REDIS_URL`` and ``TOKENRELAY_NAMESPACE`` mean what they mean for the worker. There
is no ``--queue``: the gateway routes each request to the queue whose workers serve its model.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator

from protocol.settings import CliSettings, ConnectionSettings, key_part, unset
from protocol.keys import MAX_SHARDS

_CONN = ConnectionSettings.model_fields


class GatewaySettings(CliSettings):
    """Options of ``python -m producer_sdk.gateway``."""

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
    keepalive_s: float = Field(10.0, gt=0, description="Seconds between ': keep-alive' SSE "
                               "comments while a stream has nothing to send.")
    status_wait_s: float = Field(2.0, ge=0, description="Seconds a stream waits for its first "
                                 "token before it sends its headers: an error by then (an "
                                 "expired deadline) gets its HTTP status, a later one an SSE "
                                 "error event.")
    retry_after_s: int = Field(1, ge=0, description="Retry-After of a 429 (queue full).")
    models_refresh_s: float = Field(1.0, ge=0, description="Seconds the model list read from "
                                    "worker heartbeats is reused.")
    log_level: str = Field("info", description="uvicorn log level: debug, info, warning, error.")

    _key_parts = field_validator("namespace")(key_part)
