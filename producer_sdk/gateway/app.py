"""The OpenAI-compatible HTTP gateway: FastAPI routes over the async producer SDK.

``POST /v1/completions`` and ``POST /v1/chat/completions`` become one job each on the queue of
the request's ``model`` (``models.ModelDirectory``), streamed back as OpenAI's chunks (SSE) or
answered whole; ``GET /v1/models`` lists the live models, ``GET /health`` says whether Redis
answers, ``GET /metrics`` is Prometheus text. Request bodies are mapped by
``openai_format.parse_request`` and validated by the SDK with the wire schema, so a bad value is
refused with the same message a worker would give, as a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from producer_sdk.aio import AsyncClient
from producer_sdk.client_core import make_async_redis
from producer_sdk.config import ClientConfig
from producer_sdk.openai_format import (CHAT_URL, COMPLETIONS_URL, LineError, OpenAIRequest,
                                        model_body, parse_request)
from producer_sdk.gateway.auth import KeyRing, bearer_token, load_keys
from producer_sdk.gateway.errors import (APIError, api_error, model_not_found, no_live_worker,
                                         unauthorized)
from producer_sdk.gateway.metrics import GatewayMetrics
from producer_sdk.gateway.models import HeartbeatDirectory, ModelDirectory, parse_routes
from producer_sdk.gateway.responses import (Answer, JobFeed, event_stream, first_item,
                                            whole_response)
from producer_sdk.gateway.settings import GatewaySettings
from producer_sdk.structured import fit_tools, rename_error
from protocol.topology import cluster_flag, detect_cluster

REQUEST_ID = "x-request-id"
TIMEOUT_HEADER = "x-request-timeout"
ENDPOINTS = frozenset({COMPLETIONS_URL, CHAT_URL, "/v1/models", "/health", "/metrics"})


class RequestIdMiddleware:
    """Echoes ``X-Request-Id`` (or a fresh one) on every answer and counts answers by status.
    Pure ASGI, not BaseHTTPMiddleware: that one would sit between a stream and the client's
    disconnect, which must reach the stream to cancel its job."""

    def __init__(self, app: Any, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(REQUEST_ID.encode())
        rid = given.decode("latin-1")[:200] if given else f"req-{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = rid
        path = scope.get("path", "")
        path = path if path in ENDPOINTS else "other"     # bounded label values

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (REQUEST_ID.encode(), rid.encode())]
                self.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, send_with_id)


class Gateway:
    """What the routes share: settings, keys, Redis, one AsyncClient per queue, the model
    directory and the metrics."""

    def __init__(self, settings: GatewaySettings, directory: Optional[ModelDirectory],
                 metrics: GatewayMetrics) -> None:
        self.s = settings
        self.keys = KeyRing(load_keys(settings.api_keys, settings.api_keys_file))
        self.routes = parse_routes(settings.routes)
        self.metrics = metrics
        self._directory = directory
        self.redis: Any = None
        self.clients: dict[str, AsyncClient] = {}

    async def open(self) -> None:
        """Connect: one Redis client (a cluster client when ``--cluster`` says so or the
        server is a cluster node; asked in a thread) shared by every queue's AsyncClient."""
        config = ClientConfig(redis_url=self.s.redis_url, namespace=self.s.namespace,
                              cluster=cluster_flag(self.s.cluster))
        cluster = config.cluster
        if cluster is None:
            cluster = await asyncio.to_thread(detect_cluster, config.redis_url,
                                              config.connect_timeout_s)
        self.redis = make_async_redis(config, cluster)
        if self._directory is None:
            self._directory = HeartbeatDirectory(self.redis, self.s.namespace, self.routes,
                                                 self.s.models_refresh_s)

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()

    @property
    def directory(self) -> ModelDirectory:
        assert self._directory is not None, "Gateway.open() not called"
        return self._directory

    def client(self, queue: str) -> AsyncClient:
        """The queue's client, all of them on one Redis connection pool."""
        if queue not in self.clients:
            self.clients[queue] = AsyncClient(self.s.redis_url, queue=queue,
                                              namespace=self.s.namespace,
                                              redis_client=self.redis, shards=self.s.shards)
        return self.clients[queue]

    def priority(self, request: Request) -> int:
        """The caller's lane; APIError 401 when keys are configured and its key is not one."""
        if not self.keys.enabled:
            return self.s.default_priority
        key = self.keys.find(bearer_token(request.headers.get("authorization")))
        if key is None:
            raise unauthorized()
        return self.s.default_priority if key.priority is None else key.priority

    def deadline_s(self, request: Request) -> float:
        """--deadline-s, lowered by an ``X-Request-Timeout`` header (seconds)."""
        raw = request.headers.get(TIMEOUT_HEADER)
        if raw is None:
            return self.s.deadline_s
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise APIError(400, f"X-Request-Timeout must be a positive number of seconds, got "
                           f"{raw!r:.40}", "invalid_request_error", "X-Request-Timeout",
                           "invalid_request")
        return min(value, self.s.deadline_s)

    async def queue_of(self, model: Optional[str]) -> str:
        """The queue of a live model; APIError 400 / 404 / 503 otherwise."""
        if not model:
            raise APIError(400, "model is required (GET /v1/models lists them)",
                           "invalid_request_error", "model", "invalid_request")
        queue = await self.directory.queue_for(model)
        if queue is not None:
            return queue
        known = await self.directory.known_queue(model)
        if known is not None:
            raise no_live_worker(model, known)
        raise model_not_found(model, sorted({m.name for m in await self.directory.models()}))

    async def tool_format(self, model: str) -> Optional[str]:
        """What the model's chat template does with tools, as its live workers advertise it."""
        served = {m.name: m for m in await self.directory.models()}.get(model)
        return getattr(served, "tool_format", None)

    async def submit(self, request: Request, req: OpenAIRequest) -> Answer:
        priority = self.priority(request)
        deadline = self.deadline_s(request)
        queue = await self.queue_of(req.model)
        kwargs = dict(req.kwargs)
        if req.tools is not None:           # tools as the served model's template takes them
            kwargs = fit_tools(kwargs, req.tools, await self.tool_format(req.model or ""),
                               req.model or "")
        meta = {**kwargs.pop("metadata", {}), "request_id": request.state.request_id}
        if req.user is not None:
            meta["user"] = req.user
        try:
            job = await self.client(queue).submit(**kwargs, priority=priority,
                                                  deadline_s=deadline, stream=True,
                                                  metadata=meta)
        except Exception as exc:
            raise api_error(rename_error(exc, req.constraint_param),
                            self.s.retry_after_s) from None
        top = kwargs.get("logprobs")
        return Answer(req, job, req.model or "", top if type(top) is int else 0)


async def _body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}",
                       "invalid_request_error", None, "invalid_json") from None


def create_app(settings: Optional[GatewaySettings] = None,
               directory: Optional[ModelDirectory] = None) -> FastAPI:
    """The gateway app; ``directory`` replaces the heartbeat-reading one (tests, other routing)."""
    settings = settings or GatewaySettings()
    metrics = GatewayMetrics()
    gw = Gateway(settings, directory, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gw.open()
        try:
            yield
        finally:
            await gw.close()

    app = FastAPI(title="tokenrelay gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gw
    app.add_middleware(RequestIdMiddleware, metrics=metrics)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(LineError)
    async def _line_error(_: Request, exc: LineError) -> JSONResponse:
        return await _api_error(_, api_error(exc))

    async def generate(request: Request, url: str) -> Response:
        endpoint = metrics.in_flight.labels(url)
        endpoint.inc()
        try:
            req = parse_request(url, await _body(request), streaming=True)
            answer = await gw.submit(request, req)
            headers = {"X-Job-Id": answer.job.id}
            if req.stream:
                feed = JobFeed(answer.job)
                first = await first_item(feed, settings.status_wait_s)
                return StreamingResponse(
                    event_stream(answer, feed, first, settings.keepalive_s, metrics),
                    media_type="text/event-stream",
                    headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            body = await whole_response(answer, request.is_disconnected, metrics)
            if body is None:            # the client left; its job was cancelled
                return Response(status_code=499)
            return JSONResponse(body, headers=headers)
        finally:
            endpoint.dec()

    @app.post(COMPLETIONS_URL)
    async def completions(request: Request) -> Response:
        return await generate(request, COMPLETIONS_URL)

    @app.post(CHAT_URL)
    async def chat_completions(request: Request) -> Response:
        return await generate(request, CHAT_URL)

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        gw.priority(request)            # auth
        try:
            served = await gw.directory.models()
        except Exception as exc:
            raise api_error(exc) from None
        seen: dict[str, dict[str, Any]] = {}
        for m in served:
            seen.setdefault(m.name, model_body(m.name, m.created))
        return {"object": "list", "data": list(seen.values())}

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            await gw.redis.ping()
        except Exception as exc:
            return JSONResponse({"status": "unavailable",
                                 "error": f"Redis: {type(exc).__name__}: {exc}"}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
