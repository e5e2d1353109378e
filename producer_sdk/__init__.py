"""What producers import: sync/async clients, the bulk batch runner and the CLI. Never imports torch.

    from tokenrelay.producer_sdk import Client
    client = Client("redis://localhost:6379/0", queue="default")
    job = client.submit("Hello", max_tokens=32, temperature=0)
    for delta in job.stream():
        print(delta.text, end="", flush=True)

Names are imported lazily, so ``import producer_sdk`` stays cheap; the contract names
(``SamplingParams``, ``Limits``, ``ShardCountMismatch``) live in the ``protocol`` package, which
the worker and the engine import too.
"""

from __future__ import annotations

if not __name__.startswith("tokenrelay."):   # the bare folder, imported from the repository root
    raise ImportError(f"import tokenrelay.{__name__} (commands: `tokenrelay ...`), not {__name__!r}: "
                      "our packages live under the tokenrelay namespace")

from tokenrelay._lazy import lazy_exports

_LAZY = {
    "Client": "tokenrelay.producer_sdk.client",
    "AsyncClient": "tokenrelay.producer_sdk.aio",
    "AsyncJob": "tokenrelay.producer_sdk.aio",
    "Job": "tokenrelay.producer_sdk.jobs.job",
    "Result": "tokenrelay.producer_sdk.jobs.job",
    "CompletionOutput": "tokenrelay.producer_sdk.jobs.job",
    "Delta": "tokenrelay.producer_sdk.jobs.job",
    "ClientConfig": "tokenrelay.producer_sdk.config",
    "SamplingParams": "tokenrelay.protocol.sampling_params",
    "Limits": "tokenrelay.protocol.limits",
    "DEFAULT_LIMITS": "tokenrelay.protocol.limits",
    "InvalidRequest": "tokenrelay.producer_sdk.errors",
    "JobFailed": "tokenrelay.producer_sdk.errors",
    "JobNotFound": "tokenrelay.producer_sdk.errors",
    "ModelNotFound": "tokenrelay.producer_sdk.errors",
    "QueueFull": "tokenrelay.producer_sdk.errors",
    "NotDurable": "tokenrelay.producer_sdk.errors",
    "ShardCountMismatch": "tokenrelay.protocol.shards",
    "RedisUnavailable": "tokenrelay.producer_sdk.errors",
    "SDKError": "tokenrelay.producer_sdk.errors",
    "ClientClosed": "tokenrelay.producer_sdk.errors",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
