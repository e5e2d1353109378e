"""The worker's Redis connection, what its errors mean, and how long to wait before retrying.

Every Redis error the worker sees is classified here, once (docs/contracts.md, "Redis errors"):

* transient (out of memory, LOADING, BUSY, READONLY, TRYAGAIN, MASTERDOWN, connection loss, and
  a Redis Cluster's CLUSTERDOWN, MOVED/ASK and lost or uncovered slots while it fails over or
  moves slots): the server will be fine again. The worker pauses intake, keeps everything it
  holds and retries with backoff (a cluster client re-reads the slot map first); it never fails
  or dead-letters a job for it.
* permanent configuration (wrong password, NOAUTH, ACL NOPERM, a server in protected mode
  (DENIED), TLS verification failure,
  ``--cluster on`` against a server that is not a cluster node): no retry can fix it, so the
  worker says so in one line and exits 78 (EX_CONFIG).
* anything else (e.g. WRONGTYPE on one job's key) concerns what the command touched: the caller
  ends that job alone.
"""

from __future__ import annotations

import random
import ssl
import time
from enum import Enum
from typing import Any, Optional, Union

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tokenrelay.protocol import topology
from tokenrelay.protocol.topology import redact_url

EXIT_CONFIG = 78
_TRANSIENT_PREFIXES = ("OOM", "LOADING", "BUSY", "READONLY", "TRYAGAIN", "MASTERDOWN",
                       "CLUSTERDOWN", "MOVED", "ASK")
# DENIED: a server in protected mode (no password, not bound to loopback) refuses every client
# that is not on loopback; only its operator can change that.
_PERMANENT_PREFIXES = ("WRONGPASS", "NOAUTH", "NOPERM", "DENIED")
_TRANSIENT_TYPES = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.BusyLoadingError,
                    redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError,
                    redis.exceptions.TryAgainError, redis.exceptions.MasterDownError,
                    redis.exceptions.ClusterError, redis.exceptions.AskError,
                    redis.exceptions.RedisClusterException)
# What the worker's loop catches: redis-py's cluster client raises RedisClusterException (not a
# RedisError) when no node answers or a slot has no master for a moment during a failover.
REDIS_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException)
# The client every collaborator is given: one server's, or a cluster's (``client_for``).
RedisClient = Union[redis.Redis, redis.RedisCluster]
_PERMANENT_TYPES = (redis.AuthenticationError, redis.exceptions.AuthorizationError,
                    redis.exceptions.NoPermissionError, ssl.SSLCertVerificationError,
                    topology.ClusterModeError)
_NOT_A_CLUSTER = "cluster mode is not enabled"   # redis-py's words for --cluster on, plain server


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
        text = str(e)
        if (isinstance(e, _PERMANENT_TYPES) or "certificate verify failed" in text
                or _NOT_A_CLUSTER in text.lower() or text.lstrip("-").startswith("DENIED")):
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
    chain = _chain(exc)
    if any(isinstance(e, topology.ClusterModeError) for e in chain):
        return (f"redis configuration error at {redact_url(url)}: --cluster on, but the server "
                f"is not a Redis Cluster node (cluster_enabled:0); use --cluster auto or off "
                f"(TOKENRELAY_CLUSTER), or point --redis-url at a node of the cluster")
    if any(str(e).lstrip("-").startswith("DENIED") for e in chain):
        return (f"redis at {redact_url(url)} runs in protected mode and refuses clients not on "
                f"its loopback: give it a password (requirepass, or an ACL user) and put it in "
                f"--redis-url, or set protected-mode no on a trusted network")
    # the refusal itself, not what a client library wrapped it in
    exc = next((e for e in chain if isinstance(e, _PERMANENT_TYPES)), exc)
    return (f"redis configuration error at {redact_url(url)}: {type(exc).__name__}: {exc}; "
            f"check the password/user in --redis-url, the ACL rules of that user and the TLS "
            f"CA (?ssl_ca_certs= or SSL_CERT_FILE); see docs/operations.md")


def client_for(url: str, cluster: Any = "auto", **kwargs: Any) -> Any:
    """``topology.make_client`` for the worker's commands (``cluster``: the auto/on/off
    setting); ``--cluster on`` against a plain server raises ``topology.ClusterModeError``
    (a configuration error) instead of redis-py's "cannot be connected"."""
    try:
        return topology.make_client(url, topology.cluster_flag(cluster), **kwargs)
    except redis.exceptions.RedisClusterException as exc:
        # redis-py says "not enabled" for any refused CLUSTER SLOTS, an ACL's NOPERM too
        refused = any(isinstance(e, _PERMANENT_TYPES) for e in _chain(exc))
        if _NOT_A_CLUSTER in str(exc).lower() and not refused:
            raise topology.ClusterModeError(str(exc)) from exc
        raise


def connect(url: str, block_ms: int = 0, cluster: Any = "auto") -> Any:
    """The worker's client (``redis.Redis``, or ``RedisCluster`` for a cluster) without
    redis-py's silent retries: a retried XREADGROUP could lose the entries of the lost reply,
    so connection errors reach the loop, which re-reads its pending list. The cluster client
    still follows MOVED/ASK by itself (that resends nothing that ran)."""
    return client_for(url, cluster, protocol=2, socket_connect_timeout=2.0,
                      socket_timeout=max(5.0, block_ms / 1000.0 + 5.0),
                      retry=Retry(NoBackoff(), 0), health_check_interval=0)


class ServerRestarts:
    """Notices that the Redis server restarted, error or not: its run id (``INFO server``)
    changes at every start.

    Why: a restart that fits between two of the worker's commands is invisible to it (redis-py's
    pool replaces closed connections silently). Every held job's next write finds what its
    stream lost by itself (protocol/scripts/results.py), but an entry whose terminal event and
    ack the restart lost is pending under this worker again while it no longer holds it: told of
    the restart, the worker re-reads its own pending entries at once instead of leaving them
    until their lease expires. A Redis Cluster's nodes each have their own run id and fail over
    with errors the worker sees, so only a single server is watched. A user whose ACL rules lack
    ``+info`` (the rule set before this check) turns the check off, said once in the log: the
    check of every write still holds."""

    def __init__(self, client: Any, log: Any) -> None:
        self.client = client
        self.log = log
        self.run_id: Optional[str] = None
        self.enabled = not topology.is_cluster(client)

    def restarted(self) -> bool:
        """Read the run id; True when it differs from the one read last time."""
        if not self.enabled:
            return False
        try:
            run_id = str(self.client.info("server").get("run_id", "")) or None
        except redis.exceptions.NoPermissionError as exc:
            self.enabled = False
            self.log.warning("cannot read the redis server's run id (the ACL user lacks +info); "
                             "restarts are found by each job's next write only", error=str(exc))
            return False
        before, self.run_id = self.run_id, run_id
        return before is not None and run_id is not None and run_id != before


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
