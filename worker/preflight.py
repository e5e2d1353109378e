"""Redis is checked before the model loads: a URL that can never work costs no model load.

Loading a model takes 13-46 s (and minutes for a large one on a GPU); a mistyped ``--redis-url``,
a wrong password or a user without the worker's ACL permissions used to surface only after it.
Here the worker connects, authenticates, pings and reads one key of its queue first:

* a URL that is not a Redis URL, a refused password, a missing permission, a TLS verification
  failure: one error line naming the fix, exit 78 (the worker's other configuration errors);
* an unreachable or busy server (not started yet, restarting, loading its AOF): a warning, and
  the model loads anyway; the worker's loop connects with backoff once it is loaded, as it does
  whenever Redis goes away (docs/contracts.md, "Redis errors").
"""

from __future__ import annotations

from typing import Any, Optional

from tokenrelay.protocol import topology
from tokenrelay.protocol.topology import redact_url
from tokenrelay.worker.config import WorkerSettings
from tokenrelay.worker.connection import (EXIT_CONFIG, REDIS_ERRORS, ErrorKind, classify, connect,
                               describe_permanent)

_URL_HELP = ("expected redis://[[user]:password@]host[:port][/db], rediss://... (TLS) or "
             "unix:///path/to/redis.sock")


def check_redis(settings: WorkerSettings, log: Any) -> Optional[int]:
    """None when the worker may go on to load its model; ``EXIT_CONFIG`` after one error line
    when the Redis settings can never work."""
    url = settings.redis_url
    client = None
    try:
        client = connect(url, cluster=settings.cluster)
        client.ping()
        client.exists(settings.keys.config)     # the key pattern of the worker's ACL user
    except ValueError as exc:                   # redis-py's word for a URL it cannot parse
        log.error(f"bad --redis-url {redact_url(url)}: {exc}; {_URL_HELP}",
                  exit_code=EXIT_CONFIG)
        return EXIT_CONFIG
    except (*REDIS_ERRORS, topology.ClusterModeError) as exc:
        if classify(exc) is ErrorKind.PERMANENT:
            log.error(describe_permanent(exc, url), exit_code=EXIT_CONFIG)
            return EXIT_CONFIG
        log.warning("redis not reachable yet; loading the model, then connecting with backoff",
                    redis_url=redact_url(url), error=str(exc))
    finally:
        if client is not None:
            client.close()
    return None
