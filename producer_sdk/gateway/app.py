"""The OpenAI-compatible HTTP gateway: FastAPI routes over the async producer SDK.

``POST /v1/completions`` and ``POST /v1/chat/completions`` become one job each on the queue of
the request's ``model`` (``models.ModelDirectory``), streamed back as OpenAI's chunks (SSE) or
answered whole; ``GET /v1/models`` lists the live models, ``GET /health`` says whether Redis
answers, ``GET /metrics`` is Prometheus text. Request bodies are checked at the door
(``guard.py``: type, size, time, the in-flight limit), mapped by ``openai_format.parse_request``
and validated by the SDK with the wire schema, so a bad value is refused with the same message
a worker would give, as a 400 naming the field. Whatever fails, the answer is OpenAI's error
object (``errors.py``): unknown paths and methods, Redis down, a bug.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenrelay.producer_sdk.errors import JobNotFound, RedisUnavailable
from tokenrelay.producer_sdk.gateway.access_log import AccessLog
from tokenrelay.producer_sdk.gateway.backend import Gateway, Submitted
from tokenrelay.producer_sdk.gateway.errors import APIError, api_error
from tokenrelay.producer_sdk.gateway.guard import ON_DISCONNECT, WATCH_HANGUP, Guard
from tokenrelay.producer_sdk.gateway.metrics import GatewayMetrics
from tokenrelay.producer_sdk.gateway.models import ModelDirectory
from tokenrelay.producer_sdk.gateway.responses import (Answer, JobFeed, Renderer, catch_up,
                                                       event_stream, first_item, whole_response)
from tokenrelay.producer_sdk.gateway.resume import (LAST_EVENT_ID, STREAMS_URL, EventId, Marks,
                                                    StreamSpec, body_digest, check_job_id,
                                                    parse_event_id, render_body)
from tokenrelay.producer_sdk.gateway.stream_records import Held
from tokenrelay.producer_sdk.gateway.settings import GatewaySettings
from tokenrelay.producer_sdk.gateway.tokenize import (DETOKENIZE_URL, TOKENIZE_URL, detokenize,
                                                      tokenize)
from tokenrelay.producer_sdk.openai.format import (CHAT_URL, COMPLETIONS_URL, LineError, model_body,
                                        parse_request)

log = logging.getLogger("tokenrelay.producer_sdk.gateway")


def _body(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        why = "it is nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise APIError(400, f"the request body is not valid JSON: {why}",
                       "invalid_request_error", None, "invalid_json") from None


def _register_errors(app: FastAPI, gw: Gateway) -> None:
    """Every failure as OpenAI's error object."""

    def answer(exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return answer(exc)

    @app.exception_handler(LineError)
    async def _line_error(_: Request, exc: LineError) -> JSONResponse:
        return answer(api_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 405:
            err = APIError(405, f"{request.method} is not allowed on {request.url.path}",
                           "invalid_request_error", None, "method_not_allowed",
                           dict(exc.headers or {}))
        elif exc.status_code == 404:
            err = APIError(404, f"no such endpoint: {request.method} {request.url.path} "
                           f"(POST {COMPLETIONS_URL}, POST {CHAT_URL}, GET /v1/models, "
                           f"POST {TOKENIZE_URL}, POST {DETOKENIZE_URL}, "
                           f"GET {STREAMS_URL}/<job id>, GET /health, GET /metrics)",
                           "invalid_request_error", None,
                           "unknown_url")
        else:
            err = APIError(exc.status_code, str(exc.detail), "invalid_request_error")
        return answer(err)

    @app.exception_handler(RedisUnavailable)
    async def _redis_down(_: Request, exc: RedisUnavailable) -> JSONResponse:
        return answer(api_error(exc, gw.s.retry_after_s))

    @app.exception_handler(RedisError)
    async def _redis_error(request: Request, exc: RedisError) -> JSONResponse:
        err = api_error(exc, gw.s.retry_after_s)
        if err.code == "internal":
            log.error("%s %s: Redis answered %s", request.method, request.url.path, exc)
        return answer(err)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(APIError(400, f"invalid request: {exc.errors()[:1]}",
                               "invalid_request_error", None, "invalid_request"))

    @app.exception_handler(Exception)
    async def _anything(request: Request, exc: Exception) -> JSONResponse:
        err = api_error(exc, gw.s.retry_after_s)
        if err.status >= 500 and err.code == "internal":
            log.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
        return answer(err)


def create_app(settings: Optional[GatewaySettings] = None,
               directory: Optional[ModelDirectory] = None) -> FastAPI:
    """The gateway app; ``directory`` replaces the heartbeat-reading one (tests, other
    routing)."""
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

    app = FastAPI(title="tokenrelay gateway", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.gateway = gw
    app.add_middleware(Guard, settings=settings, metrics=metrics, keys=gw.keys)
    app.add_middleware(AccessLog)       # outermost: what the guard refuses is logged too
    _register_errors(app, gw)
    metrics.bind(gw)

    async def generate(request: Request, url: str) -> Response:
        endpoint = metrics.in_flight.labels(url)
        endpoint.inc()
        try:
            body = _body(await request.body())
            last = request.headers.get(LAST_EVENT_ID)
            if last is not None and isinstance(body, dict) and body.get("stream") is True:
                after = parse_event_id(last)        # the same request, resent by its client
                return await resume(request, after.job_id, after, body_digest(body))
            req = parse_request(url, body, streaming=True)
            request.state.model = req.model     # for the access log line
            sub = await gw.submit(request, req)
            try:
                return await answer(request, req, sub, body)
            except APIError as exc:     # the caller may look the job up: name it
                exc.headers = {**exc.headers, "X-Job-Id": sub.job.id}
                raise
        finally:
            endpoint.dec()

    async def answer(request: Request, req: Any, sub: Submitted, body: Any) -> Response:
        top = req.kwargs.get("logprobs")
        answer = Answer(req, sub.job, req.model or "", top if type(top) is int else 0)
        if req.stream:
            held = await open_stream(request, req, sub, answer, body)
            feed = JobFeed(sub, gw.cancels, settings.retry_after_s, on_close=leaving(held))
            gw.streams.attach(held, feed)
            request.scope["state"][ON_DISCONNECT] = feed.close     # park or cancel, at once
            watch = request.scope["state"].get(WATCH_HANGUP)
            if watch is not None and settings.resume_grace_s <= 0:
                watch(feed.hung_up)     # no grace: cancel the moment the kernel sees it leave
            first = await first_item(feed, settings.status_wait_s)
            return streaming(Renderer(answer, Marks(sub.job.id), metrics), feed, [], first,
                             held)
        feed = JobFeed(sub, gw.cancels, settings.retry_after_s)
        body = await whole_response(answer, feed, request.is_disconnected, metrics)
        if body is None:            # the client left; its job was cancelled
            return Response(status_code=499)
        return JSONResponse(body, headers={"X-Job-Id": sub.job.id})

    async def open_stream(request: Request, req: Any, sub: Submitted, answer: Answer,
                          body: Any) -> Held:
        """The stream's resume record; without it the job is cancelled (nobody could resume
        it, and nobody reads it)."""
        ends_ms = None if sub.ends_at is None else \
            int(time.time() * 1000 + (sub.ends_at - time.monotonic()) * 1000)
        spec = StreamSpec(url=req.url, body=render_body(req.url, body), created=answer.created,
                          model=answer.model, queue=sub.queue, shards=sub.job.keys.shards,
                          shard=sub.job.shard, ends_ms=ends_ms,
                          deadline_ms=getattr(sub.job.request, "deadline_ms", None))
        try:
            return await gw.streams.open(sub.job.id, gw.owner(request), body_digest(body), spec)
        except BaseException as exc:
            gw.cancels.add(sub.job.cancel_target)
            raise api_error(exc, settings.retry_after_s) from None

    def leaving(held: Held) -> Any:
        return lambda ended, gave_up: gw.streams.left(held, ended, gave_up)

    def streaming(renderer: Renderer, feed: JobFeed, ready: list[str], first: Any,
                  held: Held) -> StreamingResponse:
        async def superseded() -> bool:
            return await gw.streams.superseded(held, settings.keepalive_s)
        return StreamingResponse(
            event_stream(renderer, feed, ready, first, settings.keepalive_s, superseded),
            media_type="text/event-stream",
            headers={"X-Job-Id": held.job_id, "Cache-Control": "no-cache",
                     "X-Accel-Buffering": "no"})

    async def resume(request: Request, job_id: str, after: Optional[EventId],
                     digest: str) -> Response:
        """The rest of job ``job_id``'s stream after ``after`` (all of it for None), for the
        caller that started it: rendered again from the result stream, sent past ``after``."""
        await gw.ready()
        held = await gw.streams.claim(job_id, gw.owner(request), digest)
        try:
            await gw.streams.displace(job_id, settings.status_wait_s + 5)
            req = parse_request(held.spec.url, held.spec.body, streaming=True)
            request.state.model = req.model
            job = await reattach(held)
        except BaseException:
            gw.streams.left(held, False)
            raise
        top = req.kwargs.get("logprobs")
        answer = Answer(req, job, held.spec.model, top if type(top) is int else 0,
                        created=held.spec.created)
        feed = JobFeed(Submitted(job, held.spec.queue, held.spec.ends_at()), gw.cancels,
                       settings.retry_after_s, on_close=leaving(held))
        gw.streams.attach(held, feed)
        renderer = Renderer(answer, Marks(job_id, after), metrics, resumed=True)
        try:
            ready, first = await catch_up(renderer, feed, settings.status_wait_s)
        except APIError as exc:
            exc.headers = {**exc.headers, "X-Job-Id": job_id}
            raise
        return streaming(renderer, feed, ready, first, held)

    async def reattach(held: Held) -> Any:
        """A handle on the held job, read from the start of its result stream; 410 when Redis
        no longer holds it."""
        try:
            job = await gw.client(held.spec.queue).get(held.job_id, held.spec.queue)
        except JobNotFound:
            job = None
        except RedisError as exc:
            raise api_error(exc, settings.retry_after_s) from None
        if job is None or job.state.failure is not None:
            raise APIError(410, f"job {held.job_id} and its results are no longer in Redis "
                           f"(the workers' --result-ttl passed); send the request again "
                           f"without Last-Event-ID", "invalid_request_error", None,
                           "stream_gone")
        job.state.start_deadline_ms = held.spec.deadline_ms    # kept as the first reader did
        return job

    @app.post(COMPLETIONS_URL)
    async def completions(request: Request) -> Response:
        return await generate(request, COMPLETIONS_URL)

    @app.post(CHAT_URL)
    async def chat_completions(request: Request) -> Response:
        return await generate(request, CHAT_URL)

    async def token_call(request: Request, handler: Any) -> JSONResponse:
        """/tokenize and /detokenize: authenticated and routed by model like a generation
        request, answered by a worker of the model (gateway/tokenize.py)."""
        gw.priority(request)            # auth
        body = _body(await request.body())
        request.state.model = body.get("model") if isinstance(body, dict) else None
        return JSONResponse(await handler(gw, body))

    @app.post(TOKENIZE_URL)
    async def tokenize_route(request: Request) -> JSONResponse:
        return await token_call(request, tokenize)

    @app.post(DETOKENIZE_URL)
    async def detokenize_route(request: Request) -> JSONResponse:
        return await token_call(request, detokenize)

    @app.get(STREAMS_URL + "/{job_id}")
    async def resume_stream(request: Request, job_id: str) -> Response:
        """Resume a stream by its job id (X-Job-Id), from ``Last-Event-ID`` when sent, else
        from its first event: what EventSource sends when it reconnects."""
        endpoint = metrics.in_flight.labels(STREAMS_URL)
        endpoint.inc()
        try:
            check_job_id(job_id)
            raw = request.headers.get(LAST_EVENT_ID)
            after = parse_event_id(raw) if raw else None
            if after is not None and after.job_id != job_id:
                raise APIError(400, f"Last-Event-ID names job {after.job_id}, not {job_id}",
                               "invalid_request_error", "Last-Event-ID",
                               "invalid_last_event_id")
            return await resume(request, job_id, after, "")
        finally:
            endpoint.dec()

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        gw.priority(request)            # auth
        await gw.ready()
        try:
            served = await gw.directory.models()
        except Exception as exc:
            raise api_error(exc, settings.retry_after_s) from None
        seen: dict[str, dict[str, Any]] = {}
        for m in served:
            seen.setdefault(m.name, model_body(m.name, m.created))
        return {"object": "list", "data": list(seen.values())}

    @app.get("/health")
    async def health() -> JSONResponse:
        await gw.ping()                 # 503 redis_unavailable while it does not answer
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
