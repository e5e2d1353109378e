"""The worker's Redis connection, what its errors mean, and how long to wait before retrying.

Every Redis error the worker sees is classified here, once (docs/contracts.md, "Redis errors"):

* transient (out of memory, LOADING, BUSY, READONLY, TRYAGAIN, MASTERDOWN, connection loss):
  the server will be fine again. The worker pauses intake, keeps everything it holds and retries
  with backoff; it never fails or dead-letters a job for it.
* permanent configuration (wrong password, NOAUTH, ACL NOPERM, TLS verification failure): no
  retry can fix it, so the worker says so in one line and exits 78 (EX_CONFIG).
* anything else (e.g. WRONGTYPE on one job's key) concerns what the command touched: the caller
  ends that job alone.
"""

from __future__ import annotations

import random
import ssl
import time
from enum import Enum

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from producer_sdk._wire import redact_url

EXIT_CONFIG = 78
_TRANSIENT_PREFIXES = ("OOM", "LOADING", "BUSY", "READONLY", "TRYAGAIN", "MASTERDOWN",
                       "CLUSTERDOWN")
_PERMANENT_PREFIXES = ("WRONGPASS", "NOAUTH", "NOPERM")
_TRANSIENT_TYPES = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.BusyLoadingError,
                    redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError,
                    redis.exceptions.TryAgainError, redis.exceptions.MasterDownError)
_PERMANENT_TYPES = (redis.AuthenticationError, redis.exceptions.AuthorizationError,
                    redis.exceptions.NoPermissionError, ssl.SSLCertVerificationError)


class ErrorKind(str, Enum):
    TRANSIENT = "transient"
    PERMANENT = "permanent"
    OTHER = "other"


class PermanentRedisError(RuntimeError):
    """A Redis configuration error no retry can fix; the worker exits 78 with this message."""


def _chain(exc: BaseException) -> list[BaseException]:
    out = []
    while exc is not None and exc not in out and len(out) < 8:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def classify_text(message: str) -> ErrorKind:
    """An error reply's text (as a script's pcall returns it, e.g. ``OOM command not allowed``)."""
    head = message.split(":", 1)[-1].strip() if message.startswith("error") else message.strip()
    head = head.lstrip("-").split(" ", 1)[0].upper()
    if head.startswith(_PERMANENT_PREFIXES):
        return ErrorKind.PERMANENT
    if head.startswith(_TRANSIENT_PREFIXES) or "OOM command not allowed" in message:
        return ErrorKind.TRANSIENT
    return ErrorKind.OTHER


def classify(exc: BaseException) -> ErrorKind:
    """What a Redis exception (or error reply in a pipeline's results) means for the worker."""
    for e in _chain(exc):
        if isinstance(e, _PERMANENT_TYPES) or "certificate verify failed" in str(e):
            return ErrorKind.PERMANENT
        if isinstance(e, redis.ResponseError) and classify_text(str(e)) is ErrorKind.PERMANENT:
            return ErrorKind.PERMANENT
    if isinstance(exc, _TRANSIENT_TYPES):
        return ErrorKind.TRANSIENT
    if isinstance(exc, (redis.ResponseError, redis.exceptions.ResponseError)):
        return classify_text(str(exc))
    return ErrorKind.OTHER


def describe_permanent(exc: BaseException, url: str) -> str:
    """The one line a person reads before the worker exits 78."""
    return (f"redis configuration error at {redact_url(url)}: {type(exc).__name__}: {exc}; "
            f"check the password/user in --redis-url, the ACL rules of that user and the TLS "
            f"CA (?ssl_ca_certs= or SSL_CERT_FILE); see docs/operations.md")


def connect(url: str, block_ms: int = 0) -> redis.Redis:
    """A client without redis-py's silent retries: a retried XREADGROUP could lose the entries
    of the lost reply, so connection errors reach the loop, which re-reads its pending list."""
    return redis.Redis.from_url(url, protocol=2, socket_connect_timeout=2.0,
                                socket_timeout=max(5.0, block_ms / 1000.0 + 5.0),
                                retry=Retry(NoBackoff(), 0), health_check_interval=0)


class Backoff:
    """Exponential backoff with jitter for transient errors; ``paused`` while a wait is due."""

    def __init__(self, first_s: float = 0.05, max_s: float = 5.0) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self.failures = 0
        self._until = 0.0

    def failed(self) -> float:
        """Record a failure; returns the delay to wait before the next attempt."""
        self.failures += 1
        delay = min(self.max_s, self.first_s * 2 ** min(self.failures - 1, 10))
        delay *= 0.5 + random.random()
        self._until = time.monotonic() + delay
        return delay

    def succeeded(self) -> bool:
        """Reset; True when this ended a run of failures."""
        was, self.failures, self._until = self.failures, 0, 0.0
        return was > 0

    @property
    def paused(self) -> bool:
        return time.monotonic() < self._until

    def remaining(self) -> float:
        return max(0.0, self._until - time.monotonic())
