"""What the gateway's routes share: Redis (connected lazily), one AsyncClient per queue over
one bounded pool and one set of shared result readers, the model directory, the cancels owed,
auth, and the per-request rules (lane, deadlines, waiting for a worker).

Redis may be down when the gateway starts, or go away and come back: the gateway starts
anyway, answers 503 ``redis_unavailable`` (with Retry-After) on every endpoint while it cannot
reach it, and connects on the first request after it answers again.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import Request
from redis.exceptions import RedisError

from tokenrelay.producer_sdk.aio import AsyncClient
from tokenrelay.producer_sdk.client import Client
from tokenrelay.producer_sdk.core.client_core import make_async_redis, make_redis
from tokenrelay.producer_sdk.config import ClientConfig
from tokenrelay.producer_sdk.errors import RedisUnavailable
from tokenrelay.producer_sdk.gateway.auth import KeyRing, load_keys
from tokenrelay.producer_sdk.gateway.cancels import Cancels
from tokenrelay.producer_sdk.gateway.errors import (APIError, api_error, model_not_found, no_live_worker,
                                         unauthorized)
from tokenrelay.producer_sdk.gateway.metrics import GatewayMetrics
from tokenrelay.producer_sdk.gateway.models import HeartbeatDirectory, ModelDirectory, parse_routes
from tokenrelay.producer_sdk.gateway.resume import owner_digest
from tokenrelay.producer_sdk.gateway.stream_records import Streams
from tokenrelay.producer_sdk.gateway.settings import GatewaySettings
from tokenrelay.producer_sdk.core.hub import ReadHub
from tokenrelay.producer_sdk.openai.format import OpenAIRequest
from tokenrelay.producer_sdk.openai.structured import fit_tools, rename_error
from tokenrelay.protocol.structured_outputs import StructuredOutputsParams
from tokenrelay.protocol.topology import cluster_flag, detect_cluster, redact_url

TIMEOUT_HEADER = "x-request-timeout"
WAIT_HEADER = "x-wait-for-worker"


@dataclass
class Submitted:
    """One request's job, and when the request as a whole must be answered by (monotonic)."""

    job: Any
    queue: str
    ends_at: Optional[float]


class Gateway:
    """Settings, keys, Redis and everything on it; see the module docstring."""

    def __init__(self, settings: GatewaySettings, directory: Optional[ModelDirectory],
                 metrics: GatewayMetrics) -> None:
        self.s = settings
        self.keys = KeyRing(load_keys(settings.api_keys, settings.api_keys_file))
        self.routes = parse_routes(settings.routes)
        self.metrics = metrics
        self._given_directory = directory
        self._directory: Optional[ModelDirectory] = None
        self.config = ClientConfig(
            redis_url=settings.redis_url, namespace=settings.namespace,
            cluster=cluster_flag(settings.cluster), max_connections=settings.redis_max_connections,
            pool_timeout_s=settings.redis_pool_timeout_s,
            reconnect_timeout_s=settings.redis_retry_s, reader_streams=settings.reader_streams,
            reader_wake=settings.reader_wake, max_queued_jobs=settings.max_queued_jobs,
            max_queued_tokens=settings.max_queued_tokens)
        self.url = redact_url(settings.redis_url)
        self.redis: Any = None
        self.hub: Optional[ReadHub] = None
        self.cancels: Optional[Cancels] = None
        self.streams: Optional[Streams] = None
        self.clients: dict[str, AsyncClient] = {}
        self._connecting = asyncio.Lock()
        # /tokenize calls waiting at once: each blocks a pooled connection on its reply, so
        # they take a quarter of the pool at most and generation requests keep the rest.
        self.tokenize_slots = asyncio.Semaphore(max(1, settings.redis_max_connections // 4))
        self._last_try = 0.0

    # -- Redis, lazily
    async def open(self) -> None:
        """Try to connect; a Redis that is down is not an error yet (requests answer 503)."""
        try:
            await self.ready()
        except RedisUnavailable:
            pass

    async def ready(self) -> None:
        """Connect when not yet connected; RedisUnavailable while Redis cannot be reached (the
        cluster question is asked at most once per ``retry_after_s``)."""
        if self.redis is not None:
            return
        async with self._connecting:
            if self.redis is not None:
                return
            wait = self._last_try + max(0.2, float(self.s.retry_after_s)) - time.monotonic()
            if wait > 0 and self._last_try:
                raise RedisUnavailable(self.url, ConnectionError("not answering"))
            self._last_try = time.monotonic()
            cluster = self.config.cluster
            if cluster is None:
                try:
                    cluster = await asyncio.to_thread(detect_cluster, self.config.redis_url,
                                                      self.config.connect_timeout_s)
                except (RedisError, OSError) as exc:
                    raise RedisUnavailable(self.url, exc) from None
            self.redis = make_async_redis(self.config, cluster)
            base = self.clients["default"] = self._new_client("default")
            self.hub = base.hub
            self.cancels = Cancels(self._cancel_client(cluster), self.metrics)
            self.streams = Streams(self.redis, self.s.namespace, self.s, self.cancels,
                                   self.metrics)
            self.streams.start_sweeper()    # parked streams of any gateway, this one's too
            self._directory = self._given_directory or HeartbeatDirectory(
                self.redis, self.s.namespace, self.routes, self.s.models_refresh_s)

    async def close(self) -> None:
        if self.streams is not None:        # before the cancels: it may owe some
            await self.streams.close()
        if self.cancels is not None:
            await self.cancels.close()
            self.cancels.client.close()
        if self.hub is not None:
            await self.hub.close()
        if self.redis is not None:
            await self.redis.aclose()

    async def ping(self) -> None:
        await self.ready()
        try:
            await self.redis.ping()
        except RedisError as exc:
            raise RedisUnavailable(self.url, exc) from None

    @property
    def directory(self) -> ModelDirectory:
        assert self._directory is not None, "Gateway.ready() not awaited"
        return self._directory

    def _cancel_client(self, cluster: bool) -> Client:
        """The blocking client ``Cancels``' thread sends with, on connections of its own: a
        cancel must not wait for a connection behind the submits and reads of thousands of
        streams (at 2,000 streams the shared pool's 64 connections were all taken while the
        streams opened, and a cancel waited up to 3.6 s for one), nor for turns of the event
        loop (cancels.py; issue #42)."""
        settings = self.config.model_dump(exclude={"queue", "namespace", "redis_url", "shards"})
        return Client(self.s.redis_url, namespace=self.s.namespace,
                      redis_client=make_redis(self.config, cluster), shards=self.s.shards,
                      **settings)

    def _new_client(self, queue: str) -> AsyncClient:
        settings = self.config.model_dump(exclude={"queue", "namespace", "redis_url", "shards"})
        return AsyncClient(self.s.redis_url, queue=queue, namespace=self.s.namespace,
                           redis_client=self.redis, hub=self.hub, shards=self.s.shards,
                           **settings)

    def client(self, queue: str) -> AsyncClient:
        """The queue's client: all on one pool and one set of shared readers."""
        if queue not in self.clients:
            self.clients[queue] = self._new_client(queue)
        return self.clients[queue]

    # -- per request
    def priority(self, request: Request) -> int:
        """The caller's lane, from the key the front door authenticated (``guard.py``: before
        the body was read); 401 on a route it did not authenticate while keys are configured."""
        key = getattr(request.state, "api_key", None)
        if key is None:
            if self.keys.enabled:
                raise unauthorized()
            return self.s.default_priority
        return self.s.default_priority if key.priority is None else key.priority

    def owner(self, request: Request) -> str:
        """Who may resume the request's stream: its API key's digest ('-' with auth off)."""
        self.priority(request)          # 401 without a key while keys are configured
        key = getattr(request.state, "api_key", None)
        return owner_digest(None if key is None else key.key)

    @staticmethod
    def producer(request: Request) -> Optional[str]:
        """The producer id the caller's jobs carry: its API key's fingerprint (None with auth
        off: every caller is then one anonymous producer to the workers)."""
        key = getattr(request.state, "api_key", None)
        return None if key is None else key.producer

    def timeouts(self, request: Request) -> tuple[float, Optional[float]]:
        """(start deadline, total) in seconds: ``--deadline-s`` and ``--request-timeout-s``,
        both lowered by an ``X-Request-Timeout`` header."""
        raw = request.headers.get(TIMEOUT_HEADER)
        if raw is None:
            return self.s.deadline_s, self.s.request_timeout_s
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not 0 < value < float("inf"):
            raise APIError(400, f"X-Request-Timeout must be a positive number of seconds, got "
                           f"{raw!r:.40}", "invalid_request_error", "X-Request-Timeout",
                           "invalid_request")
        total = min(value, self.s.request_timeout_s or value)
        return min(value, self.s.deadline_s), total

    def waits_for_worker(self, request: Request) -> bool:
        raw = request.headers.get(WAIT_HEADER)
        if raw is None:
            return self.s.wait_for_worker
        return raw.strip().lower() in ("1", "true", "yes", "on")

    async def queue_of(self, model: Optional[str], wait: bool) -> str:
        """The queue of a live model (with ``wait``: of any known one); 400 / 404 / 503."""
        if not model:
            raise APIError(400, "model is required (GET /v1/models lists them)",
                           "invalid_request_error", "model", "invalid_request")
        queue = await self.directory.queue_for(model)
        if queue is not None:
            return queue
        known = await self.directory.known_queue(model)
        if known is not None:
            if wait:
                return known
            raise no_live_worker(model, known, self.s.retry_after_s)
        raise model_not_found(model, sorted({m.name for m in await self.directory.models()}))

    async def tool_format(self, model: str) -> Optional[str]:
        """What the model's chat template does with tools, as its live workers advertise it."""
        served = {m.name: m for m in await self.directory.models()}.get(model)
        return getattr(served, "tool_format", None)

    async def submit(self, request: Request, req: OpenAIRequest) -> Submitted:
        """Enqueue the request's job (an unguessable job id) on its model's queue."""
        priority = self.priority(request)
        start_s, total_s = self.timeouts(request)
        await check_constraint_off_loop(req.kwargs.get("structured_outputs"))
        await self.ready()
        try:
            queue = await self.queue_of(req.model, self.waits_for_worker(request))
        except RedisError as exc:
            raise api_error(exc, self.s.retry_after_s) from None
        kwargs = dict(req.kwargs)
        if req.tools is not None:           # tools as the served model's template takes them
            try:
                fmt = await self.tool_format(req.model or "")
            except RedisError as exc:
                raise api_error(exc, self.s.retry_after_s) from None
            kwargs = fit_tools(kwargs, req.tools, fmt, req.model or "")
        meta = {**kwargs.pop("metadata", {}), "request_id": request.state.request_id}
        if req.user is not None:
            meta["user"] = req.user
        try:
            job = await self.client(queue).submit(
                **kwargs, job_id=f"gw-{secrets.token_hex(16)}", priority=priority,
                model=req.model, producer=self.producer(request), queue=queue,
                deadline_s=start_s, stream=True, metadata=meta)
        except Exception as exc:
            raise api_error(rename_error(exc, req.constraint_param),
                            self.s.retry_after_s) from None
        ends = None if total_s is None else time.monotonic() + total_s
        return Submitted(job, queue, ends)


async def check_constraint_off_loop(spec: Any) -> None:
    """Compile-check a request's constraint on a worker thread, not on the event loop: a 64 KiB
    schema took 145-176 ms there, and 40 of them stalled neighbour streams and ``/health`` for
    over a second (issue #42). The check's result, a refusal included, is cached by the
    canonical spec (``protocol.structured_outputs.grammar_problem``), so the job's own
    validation at submit, the one that answers 400, finds it there at once; nothing is
    decided here."""
    if not isinstance(spec, dict):
        return

    def check() -> None:
        try:
            StructuredOutputsParams(**spec)
        except (ValueError, TypeError):
            pass            # refused by the job's validation at submit, from the cache
    await asyncio.to_thread(check)


__all__ = ["Gateway", "Submitted", "TIMEOUT_HEADER", "WAIT_HEADER", "check_constraint_off_loop"]
