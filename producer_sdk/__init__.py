"""What producers import: sync/async clients, the bulk batch runner and the CLI. Never imports torch.

    from producer_sdk import Client
    client = Client("redis://localhost:6379/0", queue="default")
    job = client.submit("Hello", max_tokens=32, temperature=0)
    for delta in job.stream():
        print(delta.text, end="", flush=True)

Names are imported lazily, so ``import producer_sdk`` stays cheap; the contract names
(``SamplingParams``, ``Limits``, ``ShardCountMismatch``) live in the ``protocol`` package, which
the worker and the engine import too.
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
    "SamplingParams": "protocol.sampling_params",
    "Limits": "protocol.limits",
    "DEFAULT_LIMITS": "protocol.limits",
    "InvalidRequest": "producer_sdk.errors",
    "JobFailed": "producer_sdk.errors",
    "JobNotFound": "producer_sdk.errors",
    "QueueFull": "producer_sdk.errors",
    "NotDurable": "producer_sdk.errors",
    "ShardCountMismatch": "protocol.shards",
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
