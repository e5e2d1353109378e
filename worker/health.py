"""``python -m worker health``: is this worker alive and serving?

Alive means its heartbeat hash exists (it carries a TTL), its last beat is recent (within three
heartbeat intervals) and it reports its engine loaded. Exit code 0 only then, so it can be used
directly as a container liveness/readiness probe.
"""

from __future__ import annotations

import sys
from typing import Optional

import redis

from producer_sdk.protocol import Keys, now_ms


def check_health(client: redis.Redis, keys: Keys, worker_id: str,
                 heartbeat_ms: int = 1000) -> tuple[bool, str]:
    """(healthy, reason a person can read)."""
    beat = client.hgetall(keys.heartbeat(worker_id))
    if not beat:
        return False, f"no heartbeat for worker {worker_id!r} at {keys.heartbeat(worker_id)}"
    fields = {k.decode(): v.decode() for k, v in beat.items()}
    age = now_ms() - int(fields.get("ts", 0))
    if age > 3 * heartbeat_ms:
        return False, f"heartbeat of {worker_id!r} is {age} ms old (limit {3 * heartbeat_ms} ms)"
    if fields.get("engine_loaded") != "1":
        return False, f"worker {worker_id!r} is alive but its engine is not loaded"
    return True, (f"worker {worker_id!r} alive: beat {age} ms ago, held={fields.get('held')}, "
                  f"draining={fields.get('draining')}")


def main(argv: Optional[list[str]] = None) -> int:
    from worker.config import build_health_parser, settings_from_args
    args = build_health_parser().parse_args(argv)
    settings = settings_from_args(args)
    worker_id = settings.resolved_worker_id()
    try:
        client = redis.Redis.from_url(settings.redis_url, socket_timeout=3,
                                      socket_connect_timeout=3)
        ok, reason = check_health(client, settings.keys, worker_id, settings.heartbeat_ms)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        ok, reason = False, f"redis unreachable: {exc}"
    print(reason, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1
