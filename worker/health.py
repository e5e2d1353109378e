"""``tokenrelay health``: is this worker alive and serving?

Alive means its heartbeat hash exists (it carries a TTL), its last beat is recent (within three
heartbeat intervals) and it reports its engine loaded. Exit code 0 only then, so it can be used
directly as a container liveness/readiness probe; otherwise the reason is printed, with a Redis
error classified (transient, or a permanent configuration error such as a wrong password). Works
against a Redis Cluster too (the heartbeat is a queue-wide key, on whichever node serves it).
"""

from __future__ import annotations

import sys
from typing import Any

import redis

from tokenrelay.protocol.heartbeat import Heartbeat
from tokenrelay.protocol.keys import Keys
from tokenrelay.protocol.wire import now_ms
from tokenrelay.worker.config import WorkerIdentity
from tokenrelay.protocol.topology import ClusterModeError
from tokenrelay.worker.connection import (REDIS_ERRORS, ErrorKind, classify, client_for, describe_permanent,
                               redact_url)


def check_health(client: Any, keys: Keys, worker_id: str,
                 heartbeat_ms: int = 1000) -> tuple[bool, str]:
    """(healthy, reason a person can read)."""
    raw = client.hgetall(keys.heartbeat(worker_id))
    if not raw:
        return False, f"no heartbeat for worker {worker_id!r} at {keys.heartbeat(worker_id)}"
    beat = Heartbeat.decode(raw)
    age = now_ms() - beat.ts
    waiting = beat.redis_error
    if age > 3 * heartbeat_ms:
        return False, (f"heartbeat of {worker_id!r} is {age} ms old (limit {3 * heartbeat_ms} ms)"
                       + (f"; it was waiting out a redis error: {waiting}" if waiting else ""))
    if not beat.engine_loaded:
        return False, f"worker {worker_id!r} is alive but its engine is not loaded"
    return True, (f"worker {worker_id!r} alive: beat {age} ms ago, held={beat.held}, "
                  f"draining={int(beat.draining)}"
                  + (f"; waiting out a redis error: {waiting}" if waiting else ""))


def run(settings: WorkerIdentity) -> int:
    """Probe the worker ``settings`` name (``tokenrelay health`` parses them)."""
    worker_id = settings.resolved_worker_id()
    try:
        client = client_for(settings.redis_url, settings.cluster, socket_timeout=3,
                            socket_connect_timeout=3)
        ok, reason = check_health(client, settings.keys, worker_id, settings.heartbeat_ms)
    except (*REDIS_ERRORS, ClusterModeError) as exc:
        ok, reason = False, describe_redis_error(exc, settings.redis_url)
    print(reason, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def describe_redis_error(exc: BaseException, url: str) -> str:
    """Why the probe could not read the heartbeat, classified as the worker classifies it."""
    kind = classify(exc)
    if kind is ErrorKind.PERMANENT:
        return describe_permanent(exc, url)
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        what = "redis unreachable (transient)"
    else:
        what = "redis unavailable (transient)" if kind is ErrorKind.TRANSIENT else "redis error"
    return f"{what} at {redact_url(url)}: {type(exc).__name__}: {exc}"
