"""A small FastAPI backend on the producer SDK: one job per request, streamed as server-sent events.

    TOKENRELAY_REDIS_URL=redis://localhost:6379/0 uvicorn examples.fastapi_app:app --port 8000
    curl -N localhost:8000/v1/generate -H 'content-type: application/json' \\
         -d '{"prompt": "Once upon a time", "max_tokens": 64}'

Why it is shaped like this: a web backend must not hold GPU time for users who left, so when the
HTTP client disconnects mid-stream the job is cancelled (the worker aborts it within a step, or a
queued job never starts). A full queue answers 429 with Retry-After instead of queueing forever,
and an unreachable Redis answers 503 at once.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional, Union

import anyio
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokenrelay.producer_sdk import (AsyncClient, AsyncJob, InvalidRequest, JobFailed, JobNotFound, QueueFull,
                          RedisUnavailable)


class Message(BaseModel):
    role: str
    content: str


class GenerateRequest(BaseModel):
    """What a browser or service sends; sampling fields are checked again by the SDK."""

    model_config = ConfigDict(extra="forbid")

    prompt: Optional[str] = None
    messages: Optional[list[Message]] = None
    max_tokens: int = Field(default=128, ge=1, le=8192)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    priority: int = 0
    stream: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> "GenerateRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self

    def submit_kwargs(self) -> dict[str, Any]:
        sampling = self.model_dump(include={"max_tokens", "temperature", "top_p", "seed", "stop"},
                                   exclude_none=True)
        src: dict[str, Any] = {"prompt": self.prompt} if self.prompt is not None else {
            "messages": [m.model_dump() for m in self.messages or []]}
        return {**src, **sampling, "priority": self.priority, "stream": self.stream}


def sse(data: Any, event: Optional[str] = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def stream_events(job: AsyncJob) -> AsyncIterator[str]:
    """SSE for one job; cancels the job unless it reached a terminal event.

    A client disconnect cancels this generator (Starlette cancels its task group), so the cancel
    runs in a shielded scope: without the shield, the await would itself be cancelled at once.
    """
    finished = False
    try:
        yield sse({"job_id": job.id}, "job")
        async for delta in job.stream():
            yield sse({"text": delta.text, "token_ids": delta.token_ids})
        result = await job.result()
        finished = True
        yield sse(result.model_dump(mode="json"), "done")
    except JobFailed as exc:
        finished = True
        yield sse({"code": exc.code, "message": exc.message}, "error")
    finally:
        if not finished:
            with anyio.CancelScope(shield=True):
                await job.cancel()


def create_app(redis_url: Optional[str] = None, queue: str = "default",
               namespace: str = "tokenrelay") -> FastAPI:
    client_box: dict[str, AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        client_box["c"] = AsyncClient(redis_url, queue=queue, namespace=namespace)
        try:
            yield
        finally:
            await client_box.pop("c").close()

    app = FastAPI(title="tokenrelay example", lifespan=lifespan)

    @app.exception_handler(QueueFull)
    async def _full(_: Request, exc: QueueFull) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=429, headers={"Retry-After": "1"})

    @app.exception_handler(RedisUnavailable)
    async def _down(_: Request, exc: RedisUnavailable) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=503)

    @app.exception_handler(InvalidRequest)
    async def _invalid(_: Request, exc: InvalidRequest) -> JSONResponse:
        return JSONResponse({"error": str(exc), "field": exc.field}, status_code=422)

    @app.post("/v1/generate")
    async def generate(req: GenerateRequest) -> Any:
        job = await client_box["c"].submit(**req.submit_kwargs())
        if req.stream:
            return StreamingResponse(stream_events(job), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Job-Id": job.id})
        return await _result_or_error(job)

    @app.get("/v1/jobs/{job_id}")
    async def get_job(job_id: str, timeout: float = 30.0) -> Any:
        try:
            job = await client_box["c"].get(job_id)
        except (JobNotFound, ValueError) as exc:
            raise HTTPException(404, str(exc)) from None
        return await _result_or_error(job, timeout)

    @app.delete("/v1/jobs/{job_id}", status_code=202)
    async def cancel_job(job_id: str) -> dict[str, str]:
        await client_box["c"].cancel(job_id)
        return {"job_id": job_id, "status": "cancel requested"}

    @app.get("/healthz")
    async def health() -> dict[str, str]:
        await client_box["c"].ping()
        return {"status": "ok"}

    return app


async def _result_or_error(job: AsyncJob, timeout: Optional[float] = None) -> Any:
    try:
        return (await job.result(timeout=timeout)).model_dump(mode="json")
    except JobFailed as exc:
        return JSONResponse({"job_id": job.id, "code": exc.code, "message": exc.message},
                            status_code=500)
    except TimeoutError:
        return JSONResponse({"job_id": job.id, "status": "running"}, status_code=202)


app = create_app()
