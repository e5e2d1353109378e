"""The gateway's front door, as one pure-ASGI middleware: what every request goes through
before a route sees it, in this order, so that clients who send nothing hold nothing.

* ``X-Request-Id`` on every answer (the caller's, else a fresh one) and the answer counted by
  endpoint and status (``/metrics``).
* Authentication first (``--api-keys``): a generation request or ``/v1/models`` without a
  known key is 401 before its body is read or any slot is taken; the key found goes to the
  route in ``scope["state"]["api_key"]`` (its lane).
* A body is JSON or nothing: a POST whose Content-Type is not ``application/json`` is 415 (so a
  web page cannot drive a gateway on localhost with a no-preflight ``text/plain`` POST).
* A body is bounded in size: a Content-Length over ``--max-body-bytes`` is 413 before anything
  is read, a body that grows past it while read is 413 then.
* A body is bounded in time, and slow ones in number: a body not whole within
  ``--body-grace-s`` becomes a slow body, of which at most ``--max-slow-bodies`` are read at
  once (429 past it); each must be whole within its declared size at ``--body-min-rate``
  bytes/s after the grace, and never later than ``--body-timeout-s`` (408 after).
* Only a request whose body arrived counts against ``--max-in-flight`` (429 with Retry-After
  past it): 4,000 clients dribbling bodies cannot take the slots of requests being answered
  (issue #42). The route then gets the body read here, whole.

Pure ASGI rather than BaseHTTPMiddleware: that one would sit between a stream and the client's
disconnect, which must reach the stream to cancel its job. Slow *headers* never reach an ASGI
app: ``producer_sdk/gateway/http.py`` cuts those.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, Optional

from tokenrelay.producer_sdk.gateway.auth import ApiKey, KeyRing, bearer_token
from tokenrelay.producer_sdk.gateway.errors import (APIError, too_many_requests, too_many_slow_bodies,
                                                    unauthorized)
from tokenrelay.producer_sdk.gateway.metrics import GatewayMetrics
from tokenrelay.producer_sdk.gateway.resume import STREAMS_URL
from tokenrelay.producer_sdk.gateway.settings import GatewaySettings
from tokenrelay.producer_sdk.openai.format import CHAT_URL, COMPLETIONS_URL

REQUEST_ID = "x-request-id"
GENERATION = frozenset({COMPLETIONS_URL, CHAT_URL})
# vLLM's /tokenize and /detokenize: answered by a worker, so counted like generation requests
TOKEN_URLS = frozenset({"/tokenize", "/detokenize"})
COUNTED = GENERATION | TOKEN_URLS
AUTHENTICATED = COUNTED | {"/v1/models"}
ENDPOINTS = COUNTED | {"/v1/models", "/health", "/metrics", STREAMS_URL}


def resumes(path: str) -> bool:
    """``GET /v1/streams/<job id>``: a resumed generation, authenticated and counted as one."""
    return path.startswith(STREAMS_URL + "/")
# The request state's key for what runs the moment the client's disconnect is read (app.py: a
# streamed answer's feed close, which parks or cancels its job); the gateway's own server runs
# it sooner, from connection_lost (http.py).
ON_DISCONNECT = "on_disconnect"
# The request state's key, set by the gateway's own server (http.py), of a function that takes
# a hook to run from another thread the moment the kernel sees the client hang up (hangups.py).
WATCH_HANGUP = "watch_hangup"


class BodyError(Exception):
    def __init__(self, error: APIError) -> None:
        self.error = error


class Body:
    """A request body as it arrives: its chunks, and whether it is whole or its client left."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.chunks: list[bytes] = []
        self.size = 0
        self.whole = False
        self.left = False

    async def read_until(self, receive: Any, ends: float) -> bool:
        """Take chunks until the body is whole or the client left (True), or the loop's clock
        passes ``ends`` (False). A chunk past the size limit is BodyError 413."""
        loop = asyncio.get_running_loop()
        while not (self.whole or self.left):
            try:
                message = await asyncio.wait_for(receive(), max(0.0, ends - loop.time()))
            except asyncio.TimeoutError:
                return False
            if message["type"] == "http.disconnect":
                self.left = True
                break
            chunk = message.get("body", b"")
            self.size += len(chunk)
            if self.size > self.limit:
                raise BodyError(too_large(self.size, self.limit))
            self.chunks.append(chunk)
            self.whole = not message.get("more_body", False)
        return True

    def replay(self, receive: Any) -> Optional[Any]:
        """A ``receive`` that gives the body whole, then the client's own events (a
        disconnect); None when the client left before its body was whole."""
        if self.left:
            return None
        body = b"".join(self.chunks)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        return replay


def noticing_disconnect(receive: Any, state: dict) -> Any:
    """``receive`` that runs the request's ``ON_DISCONNECT`` hook in the same turn of the event
    loop that reads the client's disconnect. Why: otherwise a streamed answer owes its job's
    cancel only once its task has been cancelled and has unwound, a turn later, and at 2,000
    streams on a 2-core host a turn of the gateway's loop took tens of milliseconds, an engine
    step or two (issue #42)."""
    async def noticing() -> dict:
        message = await receive()
        if message["type"] == "http.disconnect":
            hook = state.pop(ON_DISCONNECT, None)
            if hook is not None:
                hook()
        return message
    return noticing


class Guard:
    """See the module docstring. ``in_flight`` counts generation requests being answered (their
    bodies arrived), ``slow_bodies`` the bodies read past their grace."""

    def __init__(self, app: Any, settings: GatewaySettings, metrics: GatewayMetrics,
                 keys: KeyRing) -> None:
        self.app = app
        self.s = settings
        self.metrics = metrics
        self.keys = keys
        self.in_flight = 0
        self.slow_bodies = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        given = headers.get(REQUEST_ID.encode())
        rid = given.decode("latin-1")[:200] if given else f"req-{uuid.uuid4().hex}"
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        path = scope.get("path", "")
        resuming = resumes(path)
        label = STREAMS_URL if resuming else path if path in ENDPOINTS else "other"   # bounded

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      (REQUEST_ID.encode(), rid.encode())]
                self.metrics.requests.labels(label, str(message["status"])).inc()
            await send(message)

        try:
            if path in AUTHENTICATED or resuming:
                state["api_key"] = self.authenticate(headers)
            if scope.get("method") == "POST":
                receive = await self._body(headers, receive)
        except BodyError as exc:
            await send_error(send_with_id, exc.error)
            return
        if receive is None:             # the client left while sending its body
            return
        if (scope.get("method") == "POST" and path in COUNTED) or resuming:
            await self._counted(scope, noticing_disconnect(receive, state), send_with_id)
        else:
            await self.app(scope, receive, send_with_id)

    def authenticate(self, headers: dict[bytes, bytes]) -> Optional[ApiKey]:
        """The caller's key (None with auth off); BodyError 401 for a missing or unknown one."""
        if not self.keys.enabled:
            return None
        header = headers.get(b"authorization")
        key = self.keys.find(bearer_token(header.decode("latin-1") if header else None))
        if key is None:
            raise BodyError(unauthorized())
        return key

    async def _counted(self, scope: dict, receive: Any, send: Any) -> None:
        """A generation request whose body arrived, answered within ``--max-in-flight``."""
        if self.in_flight >= self.s.max_in_flight:
            await send_error(send, too_many_requests(self.s.max_in_flight, self.s.retry_after_s))
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _body(self, headers: dict[bytes, bytes], receive: Any) -> Optional[Any]:
        """Check the body's type and size, read it within its time (a slow body within the
        slow bodies' bound); a ``receive`` that gives it whole, then the client's own events.
        None: the client left."""
        declared = self._declared_size(headers)
        loop = asyncio.get_running_loop()
        started = loop.time()
        body = Body(self.s.max_body_bytes)
        if await body.read_until(receive, started + self.s.body_grace_s):
            return body.replay(receive)
        if self.slow_bodies >= self.s.max_slow_bodies:
            raise BodyError(too_many_slow_bodies(self.s.max_slow_bodies, self.s.retry_after_s))
        self.slow_bodies += 1
        try:
            allowed = self.body_deadline_s(declared)
            if not await body.read_until(receive, started + allowed):
                raise BodyError(APIError(
                    408, f"the request body did not arrive within {allowed:.1f} s (a body "
                    f"must come at {self.s.body_min_rate} bytes/s of its Content-Length after "
                    f"--body-grace-s, within --body-timeout-s)", "invalid_request_error",
                    None, "request_timeout"))
        finally:
            self.slow_bodies -= 1
        return body.replay(receive)

    def _declared_size(self, headers: dict[bytes, bytes]) -> Optional[int]:
        """The Content-Length (None: not given); 415 for a body that is not JSON, 413 for a
        declared size over the limit."""
        kind = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
        if kind != b"application/json":
            shown = kind.decode("latin-1")[:60] or "none"
            raise BodyError(APIError(415, f"the request body must be JSON, sent with "
                                     f"'Content-Type: application/json' (got {shown})",
                                     "invalid_request_error", None, "unsupported_media_type"))
        length = headers.get(b"content-length")
        declared = int(length) if length is not None and length.isdigit() else None
        if declared is not None and declared > self.s.max_body_bytes:
            raise BodyError(too_large(declared, self.s.max_body_bytes))
        return declared

    def body_deadline_s(self, declared: Optional[int]) -> float:
        """Seconds from its start a body may take: the grace, then its declared size at the
        minimum rate; ``--body-timeout-s`` at most (and for a body of no declared size)."""
        if declared is None:
            return self.s.body_timeout_s
        return min(self.s.body_timeout_s, self.s.body_grace_s + declared / self.s.body_min_rate)


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


__all__ = ["Guard", "Body", "send_error", "REQUEST_ID", "WATCH_HANGUP", "ENDPOINTS", "GENERATION", "TOKEN_URLS",
           "COUNTED", "AUTHENTICATED"]
