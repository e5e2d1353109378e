"""The worker's link to Redis: connecting, and meeting the errors of the loop's commands.

Why its own collaborator: how a Redis error is met (classify it once, worker/connection.py; a
permanent one ends the worker with exit 78, a lost connection reconnects, any other transient
one pauses intake behind a backoff while every held job stays held) is one policy, apart from
the loop's order (worker/service.py), which only decides *what* runs and acts on the outcome.
The link owns the client, the backoff and the error being waited out (the heartbeat's
``redis_error``); what is done on a (re)connect and what a reconnect re-reads are the loop's,
handed in as callables.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import redis

from tokenrelay.protocol import topology
from tokenrelay.worker.config import WorkerSettings
from tokenrelay.worker.connection import (REDIS_ERRORS, Backoff, ErrorKind, PermanentRedisError,
                                          RedisClient, classify, connect, describe_permanent)
from tokenrelay.worker.logs import Log, RateLimitedLog
from tokenrelay.worker.metrics import WorkerMetrics


@dataclass(kw_only=True, eq=False)
class RedisLink:
    """The client, its backoff, and the transient error being waited out (None: none).

    ``stop`` is the loop's stop flag (a backoff waits on it, so stopping cuts the wait short);
    ``held`` counts the jobs held (for the logs); ``reread`` re-reads the worker's own pending
    entries after an error that may have lost track of them."""

    settings: WorkerSettings
    metrics: WorkerMetrics
    log: Log
    log_limited: RateLimitedLog
    stop: threading.Event
    held: Callable[[], int]
    reread: Callable[[], None]
    client: Optional[RedisClient] = field(default=None, init=False)
    backoff: Backoff = field(default_factory=Backoff, init=False)
    error: Optional[str] = field(default=None, init=False)

    def connect(self, prepare: Callable[[], None], give_up: Callable[[], bool]) -> bool:
        """(Re)connect, then ``prepare`` (the loop's collaborators, groups, own pending), until
        both work; False when ``give_up`` says so while stopping (past the drain deadline)."""
        while True:
            try:
                if self.client is None:
                    self.client = connect(self.settings.redis_url, self.settings.block_ms, self.settings.cluster)
                else:
                    topology.refresh(self.client)   # a failover may have moved every slot
                prepare()
                if self.backoff.succeeded():
                    self.metrics.redis_reconnects.inc()
                    self.log.info("redis reconnected")
                return True
            except (*REDIS_ERRORS, topology.ClusterModeError) as exc:
                self.check_permanent(exc)
                if self.stop.is_set() and give_up():
                    self.log.warning("giving up on redis while stopping", error=str(exc),
                                     held=self.held())
                    return False
                delay = self.backoff.failed()
                self.log_limited("warning", "redis unavailable, retrying", error=str(exc),
                                 retry_in_s=round(delay, 3))
                self.stop.wait(delay)

    def check_permanent(self, exc: BaseException) -> None:
        """Raise PermanentRedisError (exit 78, one line) for a configuration error."""
        if classify(exc) is ErrorKind.PERMANENT:
            raise PermanentRedisError(describe_permanent(exc, self.settings.redis_url)) from exc

    def guarded(self, iteration: Callable[[], bool], reconnect: Callable[[], bool]) -> bool:
        """One ``iteration`` of the loop (True: exit), its Redis errors met: a lost connection
        reconnects (True when that gives up), another transient error is waited out."""
        try:
            return iteration()
        except REDIS_ERRORS as exc:
            self.check_permanent(exc)
            if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
                self.log_limited("warning", "redis connection lost", error=str(exc))
                return not reconnect()
            self.transient(str(exc), classify(exc))
            return False

    def transient(self, error: str, kind: ErrorKind) -> None:
        """Wait out an error: intake pauses, every held job stays held and is retried. A
        cluster error (CLUSTERDOWN, MOVED, an uncovered slot) means the slot map is stale."""
        self.error = error
        topology.refresh(self.client)
        delay = self.backoff.failed()
        self.log_limited("warning", "redis command failed; pausing intake and retrying",
                         error=error, kind=kind.value, retry_in_s=round(delay, 3),
                         held=self.held())
        if kind is not ErrorKind.TRANSIENT:
            self.reread()
        self.stop.wait(delay)

    def recovered(self) -> None:
        """A flush went through: the error waited out is over (intake resumes)."""
        if not self.backoff.paused and self.backoff.succeeded():
            self.error = None
            self.log.info("redis recovered; intake resumed")
