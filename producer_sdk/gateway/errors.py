"""Every way a gateway request fails, as OpenAI's error object with the status OpenAI uses.

The SDK's exceptions say what happened; ``api_error`` turns each into the HTTP answer a client
of the OpenAI API acts on (400 fix the request, 401 fix the key, 404 fix the model name or the
path, 408/413/415 fix how it is sent, 429 retry after Retry-After, 503 retry later or start a
worker, 504 raise the deadline). The official ``openai`` client turns these into its own
exception classes by status. Messages are written for an HTTP caller: they name headers and
settings, never an SDK argument.
"""

from __future__ import annotations

from typing import Any, Optional

from tokenrelay.producer_sdk.core.effects import is_transient
from tokenrelay.producer_sdk.errors import (JOB_LOST, InvalidRequest, JobFailed, ModelNotFound, QueueFull,
                                 RedisUnavailable)
from tokenrelay.producer_sdk.openai.format import LineError, error_body

# A job's terminal error code -> HTTP status and OpenAI error type.
_JOB_CODES = {"invalid_request": (400, "invalid_request_error"),
              "prompt_too_long": (400, "invalid_request_error"),
              "expired": (504, "timeout_error"),
              JOB_LOST: (503, "service_unavailable"),
              "poison": (500, "server_error"),
              "internal": (500, "server_error")}


class APIError(Exception):
    """An HTTP error answer: ``status``, OpenAI's error object, extra headers."""

    def __init__(self, status: int, message: str, type_: str, param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def _param(field: Optional[str]) -> Optional[str]:
    """The body field an SDK error names: ``params.temperature`` is the body's ``temperature``."""
    if not field:
        return None
    return field[len("params."):] if field.startswith("params.") else field


def _retry(seconds: int) -> dict[str, str]:
    return {"Retry-After": str(seconds)}


def api_error(exc: BaseException, retry_after_s: int = 1) -> APIError:
    """The HTTP answer for an exception the SDK, Redis or the body parser raised."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, LineError):
        return APIError(400, exc.message, "invalid_request_error", exc.param, exc.code)
    if isinstance(exc, InvalidRequest):
        return APIError(400, str(exc), "invalid_request_error", _param(exc.field),
                        "invalid_request")
    if isinstance(exc, QueueFull):
        what = ("Redis is out of memory" if exc.reason == "oom" else
                f"its token budget holds {exc.tokens} tokens of {exc.token_limit}, no room for "
                f"this request's prompt and max_tokens" if exc.reason == "token budget" else
                f"it holds {exc.depth} jobs, at its limit of {exc.limit}")
        return APIError(429, f"the queue of this model is full ({what}); retry after "
                        f"{retry_after_s} s (Retry-After)", "rate_limit_error", None,
                        "queue_full", _retry(retry_after_s))
    if isinstance(exc, RedisUnavailable) or is_transient(exc):
        return redis_unavailable(retry_after_s)
    if isinstance(exc, JobFailed):
        status, type_ = _JOB_CODES.get(exc.code, (500, "server_error"))
        headers = _retry(retry_after_s) if status == 503 else None
        return APIError(status, exc.message, type_, None, exc.code, headers)
    if isinstance(exc, RecursionError):
        return APIError(400, "the request body is nested too deeply", "invalid_request_error",
                        None, "invalid_json")
    return APIError(500, f"internal gateway error ({type(exc).__name__}); the gateway's log "
                    f"has the details", "server_error", None, "internal")


def redis_unavailable(retry_after_s: int) -> APIError:
    return APIError(503, f"the gateway cannot reach its Redis right now; retry after "
                    f"{retry_after_s} s (Retry-After)", "service_unavailable", None,
                    "redis_unavailable", _retry(retry_after_s))


def unauthorized() -> APIError:
    return APIError(401, "missing or unknown API key: send 'Authorization: Bearer <key>' with "
                    "a key from the gateway's --api-keys / --api-keys-file",
                    "authentication_error", None, "invalid_api_key")


def model_not_found(model: str, served: list[str]) -> APIError:
    return APIError(404, f"{ModelNotFound(model, served)} (GET /v1/models)",
                    "invalid_request_error", "model", "model_not_found")


def no_live_worker(model: str, queue: str, retry_after_s: int = 1) -> APIError:
    return APIError(503, f"no live worker serves {model!r} (queue {queue!r}) right now; retry "
                    f"later, or send 'X-Wait-For-Worker: true' to queue the request until one "
                    f"starts (within its deadline)", "service_unavailable", "model",
                    "no_live_worker", _retry(retry_after_s))


def too_many_requests(limit: int, retry_after_s: int) -> APIError:
    return APIError(429, f"the gateway is answering {limit} requests already (its "
                    f"--max-in-flight); retry after {retry_after_s} s (Retry-After)",
                    "rate_limit_error", None, "too_many_requests", _retry(retry_after_s))


def too_many_slow_bodies(limit: int, retry_after_s: int) -> APIError:
    return APIError(429, f"the gateway is reading {limit} slow request bodies already (its "
                    f"--max-slow-bodies); send the body with the headers, or retry after "
                    f"{retry_after_s} s (Retry-After)", "rate_limit_error", None,
                    "too_many_requests", _retry(retry_after_s))


def timed_out(job_id: str, seconds: Optional[float], started: bool) -> APIError:
    """504 for a request whose time (X-Request-Timeout / --request-timeout-s) is up: code
    ``expired`` when its job had not even started (as a worker would say), else ``timeout``."""
    if not started:
        return APIError(504, f"the request's job {job_id} did not start within its timeout of "
                        f"{seconds} s (X-Request-Timeout / --request-timeout-s: the deadline "
                        f"passed); it was cancelled", "timeout_error", None, "expired")
    return APIError(504, f"the request did not finish within its timeout of {seconds} s "
                    f"(X-Request-Timeout / --request-timeout-s); its job {job_id} was "
                    f"cancelled", "timeout_error", None, "timeout")


def cancelled(job_id: str) -> APIError:
    return APIError(500, f"job {job_id} was cancelled before it finished (python -m "
                    f"producer_sdk status {job_id} says by whom)", "server_error", None,
                    "cancelled")
