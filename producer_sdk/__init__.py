"""What producers import: sync/async clients, the bulk batch runner and the CLI. Never imports torch.

    from producer_sdk import Client
    client = Client("redis://localhost:6379/0", queue="default")
    job = client.submit("Hello", max_tokens=32, temperature=0)
    for delta in job.stream():
        print(delta.text, end="", flush=True)

Names are imported lazily: ``producer_sdk.protocol`` and ``producer_sdk.sampling_params`` are the
wire contract the worker and the engine import too, and importing them must not pull in redis.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Client": "producer_sdk.client",
    "AsyncClient": "producer_sdk.aio",
    "AsyncJob": "producer_sdk.aio",
    "Job": "producer_sdk.job",
    "Result": "producer_sdk.job",
    "CompletionOutput": "producer_sdk.job",
    "Delta": "producer_sdk.job",
    "ClientConfig": "producer_sdk.config",
    "SamplingParams": "producer_sdk.sampling_params",
    "Limits": "producer_sdk.protocol",
    "DEFAULT_LIMITS": "producer_sdk.protocol",
    "InvalidRequest": "producer_sdk.errors",
    "JobFailed": "producer_sdk.errors",
    "JobNotFound": "producer_sdk.errors",
    "QueueFull": "producer_sdk.errors",
    "NotDurable": "producer_sdk.errors",
    "ShardCountMismatch": "producer_sdk.shards",
    "RedisUnavailable": "producer_sdk.errors",
    "SDKError": "producer_sdk.errors",
    "ClientClosed": "producer_sdk.errors",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'producer_sdk' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
