"""One JSON line per gateway request: who asked, which job answered, how fast.

uvicorn's access lines (``"POST /v1/chat/completions" 200``) say neither the job that
answered, nor the model, nor how long the first token took, so an operator could not follow a
slow request to its worker. ``AccessLog`` (pure ASGI, outermost, so requests the front door
refuses are logged too) writes, when a response ends (or the client leaves, or it fails)::

    {"event": "request", "request_id", "method", "path", "status", "job_id", "model",
     "stream", "ttft_ms", "total_ms"}

``job_id`` is the ``X-Job-Id`` the route answered with (None when no job was made),
``model`` what the route put in the request's state, ``ttft_ms`` the time to the first body
bytes of a stream (its first token's chunk: the gateway sends nothing before one), None for a
whole answer. The gateway turns uvicorn's own access lines off (``http.server_config``).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable, Optional

JOB_HEADER = b"x-job-id"


def _stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class AccessLog:
    """See the module docstring; ``sink`` takes each line (default: stderr)."""

    def __init__(self, app: Any, sink: Callable[[str], None] = _stderr) -> None:
        self.app = app
        self.sink = sink

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.monotonic()
        seen: dict[str, Any] = {"status": None, "job_id": None, "stream": False, "first": None}

        async def watched(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers") or [])
                seen["status"] = message["status"]
                job = headers.get(JOB_HEADER)
                seen["job_id"] = job.decode("latin-1") if job else None
                seen["stream"] = headers.get(b"content-type", b"").startswith(
                    b"text/event-stream")
            elif message["type"] == "http.response.body" and message.get("body") \
                    and seen["first"] is None:
                seen["first"] = time.monotonic()
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            self.sink(json.dumps(line(scope, seen, t0, time.monotonic())))


def line(scope: dict, seen: dict[str, Any], t0: float, t1: float) -> dict[str, Any]:
    """The log line's fields (status None: no answer started: the client left, or a bug)."""
    state = scope.get("state") or {}
    first: Optional[float] = seen["first"]
    return {"event": "request", "request_id": state.get("request_id"),
            "method": scope.get("method"), "path": scope.get("path"),
            "status": seen["status"], "job_id": seen["job_id"], "model": state.get("model"),
            "stream": seen["stream"],
            "ttft_ms": round((first - t0) * 1000, 1) if seen["stream"] and first else None,
            "total_ms": round((t1 - t0) * 1000, 1)}


__all__ = ["AccessLog", "line"]
