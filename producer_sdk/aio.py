"""The asyncio producer client: the same surface as ``Client``, with await / async for.

Meant for async web backends (FastAPI, aiohttp): nothing here blocks the event loop, and one
AsyncClient is shared by all requests of a process. Every operation is the sync client's plan
(``ClientCore``, producer_sdk/core/client_core.py), run here awaiting (``effects.arun``); only the
waiting differs.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable, Iterable, Optional, Sequence, TypeVar

import redis.asyncio as aioredis

from tokenrelay.producer_sdk.jobs import signatures
from tokenrelay.producer_sdk.client import Client
from tokenrelay.producer_sdk.core.client_core import NET_ERRORS, ClientCore, make_async_redis
from tokenrelay.producer_sdk.core.effects import Plan, arun
from tokenrelay.producer_sdk.errors import RedisUnavailable
from tokenrelay.producer_sdk.core.hub import ReadHub
from tokenrelay.producer_sdk.jobs.job import AsyncJob
from tokenrelay.producer_sdk.jobs.payloads import Prepared
from tokenrelay.producer_sdk.core.status import JobStatus
from tokenrelay.producer_sdk.core.window import MapRun, Window, map_defaults
from tokenrelay.protocol.keys import Keys
from tokenrelay.protocol.limits import DEFAULT_LIMITS, Limits
from tokenrelay.protocol.topology import detect_cluster, is_cluster

T = TypeVar("T")


@signatures.docs_from(Client)
class AsyncClient(ClientCore[aioredis.Redis]):
    """Asyncio producer client for one queue; see ``Client`` for the semantics of each method
    (``limits``, cluster and shards, durable submits, ClientClosed after ``close()``). The
    Redis client is made on first use; asking a server whether it is a cluster node runs in a
    thread, so it never blocks the event loop. Its pool is bounded (``max_connections``) and
    waits for a free connection; jobs being waited for are read by shared readers
    (``producer_sdk/core/hub.py``), not one connection each: pass one ``hub`` to several clients on
    one Redis client to share them too."""

    job_class = AsyncJob

    def __init__(self, redis_url: Optional[str] = None, queue: str = "default",
                 namespace: str = "tokenrelay", *, redis_client: Optional[Any] = None,
                 limits: Limits = DEFAULT_LIMITS, hub: Optional[ReadHub] = None,
                 **settings: Any) -> None:
        super().__init__(redis_url, queue, namespace, redis_client, limits, settings)
        self._hub = hub
        self._own_hub = hub is None

    @property
    def hub(self) -> ReadHub:
        """The shared readers of this client's waits (made on first use)."""
        if self._hub is None:
            cfg = self.config
            self._hub = ReadHub(self._run, self._reader, self.namespace,
                                per_reader=cfg.reader_streams,
                                max_readers=max(1, cfg.max_connections // 2),
                                block_ms=cfg.poll_ms, wake=cfg.reader_wake)
        return self._hub

    def _make_redis(self) -> Any:
        return make_async_redis(self.config)

    async def _conn(self) -> Any:
        """The Redis client, made now if needed (cluster detection in a thread); a cluster
        client knows its slot map (a no-op once it does), which planning per node needs."""
        if self._redis is None and not self._closed:
            cluster = self.config.cluster
            if cluster is None:
                try:
                    cluster = await asyncio.to_thread(detect_cluster, self.config.redis_url,
                                                      self.config.connect_timeout_s)
                except NET_ERRORS as exc:
                    raise RedisUnavailable(self.url, exc) from exc
            if self._redis is None:
                self._redis = make_async_redis(self.config, cluster)
        r = self.redis
        if is_cluster(r):
            try:
                await r.initialize()
            except NET_ERRORS:
                # its default node died (a failover): ask another one next time (what
                # redis-py's own command retries do), and let the plan retry
                r.replace_default_node()
                raise
        return r

    async def _run(self, plan: Plan[T]) -> T:
        """Run a plan on this client's Redis, awaiting."""
        try:
            return await arun(plan, self._conn)
        except NET_ERRORS as exc:
            raise RedisUnavailable(self.url, exc) from exc

    # -- lifecycle
    async def close(self) -> None:
        if not self._closed:
            if self._hub is not None and self._own_hub:
                await self._hub.close()
            self._closed = True
            if self._redis is not None:
                await self._redis.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def ping(self) -> None:
        await self._run(self._ping())

    async def live_workers(self, queue: Optional[str] = None) -> list[str]:
        return await self._run(self._live_workers(queue))

    async def queue_of_model(self, model: str) -> str:
        return await self._run(self._queue_of_model(model))

    # -- queues
    async def keys_of(self, queue: Optional[str] = None) -> Keys:
        return await self._run(self._keys_of(queue))

    @property
    def keys(self) -> Keys:
        """The keys of the client's queue, once known (after the first call that used Redis,
        or ``await client.keys_of()``)."""
        st = self._queues.cached()
        if st is None:
            raise RuntimeError("the queue's shard count is read on first use: "
                               "await client.keys_of() first")
        return st.keys

    async def queue_depth(self, queue: Optional[str] = None) -> int:
        return await self._run(self._queue_depth(queue))

    async def set_max_queued_jobs(self, limit: int, queue: Optional[str] = None) -> None:
        await self._run(self._set_max_queued_jobs(limit, queue))

    async def set_max_queued_tokens(self, limit: int, queue: Optional[str] = None) -> None:
        """Set the queue's shared token budget (for every producer without its own; 0: none)."""
        await self._run(self._set_max_queued_tokens(limit, queue))

    # -- submit
    @signatures.same_signature(signatures.submit)
    async def submit(self, *args: Any, **kwargs: Any) -> AsyncJob:
        return await self._run(self._submit(args, kwargs))

    async def submit_many(self, requests: Iterable[Any], *, block: bool = True,
                          block_timeout: Optional[float] = None, durable: Optional[bool] = None,
                          **defaults: Any) -> list[AsyncJob]:
        return await self._run(self._submit_many(requests, block, block_timeout, durable,
                                                 defaults))

    async def enqueue(self, prepared: Sequence[Prepared], *, block: bool,
                      block_timeout: Optional[float] = None,
                      durable: Optional[bool] = None) -> list[AsyncJob]:
        return await self._run(self._enqueue(prepared, block=block, block_timeout=block_timeout,
                                             durable=durable))

    # -- jobs
    async def get(self, job_id: str, queue: Optional[str] = None) -> AsyncJob:
        return await self._run(self._get(job_id, queue))

    async def probe(self, jobs: Sequence[AsyncJob]) -> list[str]:
        return await self._run(self._probe(jobs))

    async def status(self, job_id: str, queue: Optional[str] = None) -> JobStatus:
        return (await self.statuses([job_id], queue))[0]

    async def statuses(self, job_ids: Sequence[str],
                       queue: Optional[str] = None) -> list[JobStatus]:
        return await self._run(self._statuses(job_ids, queue))

    async def cancel(self, job_id: str, queue: Optional[str] = None) -> None:
        await self._run(self._cancel(job_id, queue))

    # -- many jobs at once
    async def iter_completed(
            self, source: Iterable[tuple[Any, Prepared]], *, concurrency: int = 64,
            block: bool = True, cancel_on_exit: bool = True,
            on_submitted: Optional[Callable[[list[tuple[Any, AsyncJob]]], None]] = None,
            durable: Optional[bool] = None) -> AsyncIterator[tuple[Any, AsyncJob]]:
        window = Window(self, source, concurrency, block, durable, self.config.poll_ms,
                        on_submitted)
        try:
            while not window.over:
                for pair in await self._run(window.refill()):
                    yield pair
                for pair in await self._run(window.read()):
                    yield pair
        finally:
            if cancel_on_exit:
                await self._run(window.cancel_rest())

    async def map(self, prompts_or_requests: Iterable[Any], *, concurrency: int = 32,
                  progress: bool = True, return_exceptions: bool = False, priority: int = 0,
                  block: bool = True, durable: Optional[bool] = None,
                  **sampling: Any) -> list[Any]:
        with MapRun(self._builder.build_request, prompts_or_requests,
                    map_defaults(sampling, {"priority": priority}), progress,
                    return_exceptions) as run_:
            async for i, job in self.iter_completed(run_.source(), concurrency=concurrency,
                                                    block=block, durable=durable):
                run_.done(i, job)
        return run_.results


__all__ = ["AsyncClient", "AsyncJob"]
