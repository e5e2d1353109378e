"""What the sync and async producer clients share before any I/O: their settings, keys, payload
builder and enqueue script, the Redis client they own, and the closed state."""

from __future__ import annotations

import hashlib
from typing import Any, Generic, Optional, TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from producer_sdk._wire import ENQUEUE_LUA, EnqueueScript, redact_url
from producer_sdk.affinity import AffinityRouter
from producer_sdk.config import ClientConfig
from producer_sdk.errors import ClientClosed
from producer_sdk.payloads import PayloadBuilder
from producer_sdk.protocol import Keys, Limits

ENQUEUE_SHA = hashlib.sha1(ENQUEUE_LUA.encode()).hexdigest()
NET_ERRORS = (RedisConnectionError, RedisTimeoutError)


def make_redis(cfg: ClientConfig, module: Any = redis) -> Any:
    """A redis(-asyncio) client with a short connect timeout and few retries: fail fast, not hang."""
    return module.Redis.from_url(
        cfg.redis_url, socket_connect_timeout=cfg.connect_timeout_s,
        socket_timeout=cfg.socket_timeout_s, socket_keepalive=True,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 1),
        retry_on_error=[RedisConnectionError, RedisTimeoutError])


R = TypeVar("R")


class ClientCore(Generic[R]):
    """What Client and AsyncClient (over client ``R``) share before any I/O: settings, keys,
    the payload builder and the enqueue script, and the closed state: after ``close()`` every
    use raises ClientClosed, never a silent reconnect."""

    def __init__(self, redis_url: Optional[str], queue: str, namespace: str,
                 redis_client: Optional[R], limits: Limits, settings: dict[str, Any],
                 module: Any) -> None:
        if redis_url is not None:
            settings["redis_url"] = redis_url
        self.config = ClientConfig(queue=queue, namespace=namespace, **settings)
        self.keys = Keys(namespace, queue)
        self.url = redact_url(self.config.redis_url)
        self._redis: R = redis_client if redis_client is not None else make_redis(self.config,
                                                                                   module)
        self._closed = False
        self._builder = PayloadBuilder(self.keys, limits=limits)
        self._script = EnqueueScript(self.keys, ENQUEUE_SHA, limit=self.config.max_queued_jobs,
                                     ttl_s=self.config.dedupe_ttl_s)
        self._other_scripts: dict[str, EnqueueScript] = {}
        self._script_loaded = False
        self._affinity = AffinityRouter(self.keys, self.config.affinity_ttl_s,
                                        self.config.affinity_max_backlog)

    def _scripts(self, queue: Optional[str]) -> EnqueueScript:
        """The enqueue script of ``queue`` (None or the client's own: the client's): a job
        prepared for another queue of the namespace (``prepare(..., queue=q)``, how the batch
        runner routes a line by its model) goes to that queue's lanes."""
        if queue is None or queue == self.keys.queue:
            return self._script
        script = self._other_scripts.get(queue)
        if script is None:
            script = self._other_scripts[queue] = EnqueueScript(
                Keys(self.keys.namespace, queue), ENQUEUE_SHA,
                limit=self.config.max_queued_jobs, ttl_s=self.config.dedupe_ttl_s)
        return script

    @property
    def redis(self) -> R:
        """The Redis client; ClientClosed after ``close()`` (never a silent reconnect)."""
        if self._closed:
            raise ClientClosed(type(self).__name__)
        return self._redis

    @property
    def closed(self) -> bool:
        return self._closed
