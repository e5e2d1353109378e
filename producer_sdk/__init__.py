"""What producers import: sync/async clients, the bulk batch runner and the CLI. Never imports torch.

    from producer_sdk import Client
    client = Client("redis://localhost:6379/0", queue="default")
    job = client.submit("Hello", max_tokens=32, temperature=0)
    for delta in job.stream():
        print(delta.text, end="", flush=True)
"""

from producer_sdk.aio import AsyncClient, AsyncJob
from producer_sdk.client import Client
from producer_sdk.config import ClientConfig
from producer_sdk.errors import (InvalidRequest, JobFailed, JobNotFound, QueueFull,
                                 RedisUnavailable, SDKError)
from producer_sdk.job import Delta, Job, Result

__all__ = ["Client", "AsyncClient", "Job", "AsyncJob", "Result", "Delta", "ClientConfig",
           "JobFailed", "QueueFull", "JobNotFound", "InvalidRequest", "RedisUnavailable",
           "SDKError"]
