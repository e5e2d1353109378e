"""The gateway's front door, as one pure-ASGI middleware: what every request goes through
before a route sees it.

* ``X-Request-Id`` on every answer (the caller's, else a fresh one) and the answer counted by
  endpoint and status (``/metrics``).
* Generation requests past ``--max-in-flight`` answered 429 with Retry-After at once, before
  their body is read.
* A body is JSON or nothing: a POST whose Content-Type is not ``application/json`` is 415 (so a
  web page cannot drive a gateway on localhost with a no-preflight ``text/plain`` POST).
* A body is bounded in size and time: a Content-Length over ``--max-body-bytes`` is 413 before
  anything is read, a body that grows past it while read is 413 then; one that takes longer
  than ``--body-timeout-s`` to arrive is 408. The route then gets the body read here, whole.

Pure ASGI rather than BaseHTTPMiddleware: that one would sit between a stream and the client's
disconnect, which must reach the stream to cancel its job. Slow *headers* never reach an ASGI
app: ``producer_sdk/gateway/http.py`` cuts those.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, Optional

from tokenrelay.producer_sdk.gateway.errors import APIError, too_many_requests
from tokenrelay.producer_sdk.gateway.metrics import GatewayMetrics
from tokenrelay.producer_sdk.gateway.settings import GatewaySettings
from tokenrelay.producer_sdk.openai_format import CHAT_URL, COMPLETIONS_URL

REQUEST_ID = "x-request-id"
GENERATION = frozenset({COMPLETIONS_URL, CHAT_URL})
ENDPOINTS = GENERATION | {"/v1/models", "/health", "/metrics"}


class BodyError(Exception):
    def __init__(self, error: APIError) -> None:
        self.error = error


class Guard:
    """See the module docstring. ``in_flight`` counts generation requests being answered."""

    def __init__(self, app: Any, settings: GatewaySettings, metrics: GatewayMetrics) -> None:
        self.app = app
        self.s = settings
        self.metrics = metrics
        self.in_flight = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(REQUEST_ID.encode())
        rid = given.decode("latin-1")[:200] if given else f"req-{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = rid
        path = scope.get("path", "")
        label = path if path in ENDPOINTS else "other"     # bounded label values

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      (REQUEST_ID.encode(), rid.encode())]
                self.metrics.requests.labels(label, str(message["status"])).inc()
            await send(message)

        generation = scope.get("method") == "POST" and path in GENERATION
        if not generation:
            await self._answer(scope, receive, send_with_id)
            return
        if self.in_flight >= self.s.max_in_flight:
            await send_error(send_with_id, too_many_requests(self.s.max_in_flight,
                                                             self.s.retry_after_s))
            return
        self.in_flight += 1
        try:
            await self._answer(scope, receive, send_with_id)
        finally:
            self.in_flight -= 1

    async def _answer(self, scope: dict, receive: Any, send: Any) -> None:
        """Read and check a POST's body, then hand the request to the app."""
        if scope.get("method") == "POST":
            try:
                receive = await self._body(dict(scope.get("headers") or []), receive)
            except BodyError as exc:
                await send_error(send, exc.error)
                return
            if receive is None:         # the client left while sending its body
                return
        await self.app(scope, receive, send)

    async def _body(self, headers: dict[bytes, bytes], receive: Any) -> Optional[Any]:
        """Check the body's type and size, read it within the time limit; a ``receive`` that
        gives it whole, then the client's own events (a disconnect). None: the client left."""
        kind = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
        if kind != b"application/json":
            shown = kind.decode("latin-1")[:60] or "none"
            raise BodyError(APIError(415, f"the request body must be JSON, sent with "
                                     f"'Content-Type: application/json' (got {shown})",
                                     "invalid_request_error", None, "unsupported_media_type"))
        limit = self.s.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise BodyError(too_large(int(length), limit))
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        ends = loop.time() + self.s.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, ends - loop.time()))
            except asyncio.TimeoutError:
                raise BodyError(APIError(408, f"the request body did not arrive within "
                                         f"{self.s.body_timeout_s} s", "invalid_request_error",
                                         None, "request_timeout")) from None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BodyError(too_large(size, limit))
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        return replay


def too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body is over {limit} bytes (at least {size}; the "
                    f"gateway's --max-body-bytes)", "invalid_request_error", None,
                    "request_too_large")


async def send_error(send: Any, error: APIError) -> None:
    """Answer ``error`` as OpenAI's JSON error object, from raw ASGI."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()),
               *((k.lower().encode(), v.encode()) for k, v in error.headers.items())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


__all__ = ["Guard", "send_error", "REQUEST_ID", "ENDPOINTS", "GENERATION"]
