"""What the sync and async producer clients share before any I/O: their settings, the Redis
client they own (one server or a cluster, made on first use), what they know of each queue they
send to (its keys with the shard count resolved, its high-water mark), the payload builder and
enqueue script, and the closed state."""

from __future__ import annotations

import threading
import time
from typing import Any, Generic, Optional, TypeVar

from redis.backoff import ExponentialBackoff
from redis.exceptions import ClusterError, RedisClusterException
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from producer_sdk._wire import (DEFAULT_MAX_QUEUED_JOBS, EnqueuePlan, EnqueueScript,
                                QueueState)
from protocol.topology import is_cluster, make_async_client, make_client, redact_url
from producer_sdk.affinity import AffinityRouter
from producer_sdk.config import ClientConfig
from producer_sdk.errors import ClientClosed, NotDurable, QueueFull, RedisUnavailable
from producer_sdk.payloads import PayloadBuilder, Prepared
from protocol.keys import Keys
from protocol.limits import Limits
from protocol.scripts import pack
from protocol.shards import SHARDS_FIELD, ShardCountMismatch, parse_shards, resolve_shards

__all__ = ["NET_ERRORS", "ClientCore", "make_redis", "make_async_redis"]

NET_ERRORS = (RedisConnectionError, RedisTimeoutError)
# What a packed send may raise while a cluster fails a master over (a lost connection, a slot
# map without a master for a slot for a moment).
SEND_ERRORS = (*NET_ERRORS, ClusterError, RedisClusterException)
LIMIT_FIELD = "max_queued_jobs"
# How long a producer reuses a queue's high-water mark (and watches for a shard count being
# registered) before reading its config hash again: one HMGET per queue per second of submits.
CONFIG_TTL_S = 1.0


def connection_kwargs(cfg: ClientConfig) -> dict[str, Any]:
    """A short connect timeout and few retries: fail fast, not hang."""
    return dict(socket_connect_timeout=cfg.connect_timeout_s, socket_timeout=cfg.socket_timeout_s,
                socket_keepalive=True, retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 1),
                retry_on_error=[RedisConnectionError, RedisTimeoutError])


def make_redis(cfg: ClientConfig, cluster: Optional[bool] = None) -> Any:
    """A sync client for ``cfg``: a Redis Cluster client when the server is a cluster node
    (``cfg.cluster`` None asks it; ``cluster`` given: already known), else redis.Redis."""
    known = cfg.cluster if cluster is None else cluster
    return make_client(cfg.redis_url, known, **connection_kwargs(cfg))


def make_async_redis(cfg: ClientConfig, cluster: Optional[bool] = None) -> Any:
    """``make_redis`` for asyncio (detection, when needed, is one short blocking call)."""
    known = cfg.cluster if cluster is None else cluster
    return make_async_client(cfg.redis_url, known, **connection_kwargs(cfg))


class Retrying:
    """How long one enqueue keeps resending what a lost connection or a failing-over cluster
    did not answer: on one Redis a single retry after 0.1 s (fail fast: it is down), on a
    cluster up to ``window_s`` (a failover takes seconds; every resend is safe, the enqueue
    script dedupes by job id), pausing 0.1 s doubling to 1 s."""

    def __init__(self, window_s: float) -> None:
        self.end = time.monotonic() + window_s
        self.tries = 0
        self.pause_s = 0.1

    def pause(self) -> Optional[float]:
        """Seconds to wait before the next try, None when it is time to give up."""
        self.tries += 1
        if self.tries > 1 and time.monotonic() >= self.end:
            return None
        pause, self.pause_s = self.pause_s, min(self.pause_s * 2, 1.0)
        return pause


R = TypeVar("R")


class ClientCore(Generic[R]):
    """What Client and AsyncClient (over client ``R``) share before any I/O: settings, the
    Redis client (made on first use: asking a server whether it is a cluster node is I/O, and
    a client is made before Redis may be up), per-queue state, the payload builder and the
    enqueue script, and the closed state: after ``close()`` every use raises ClientClosed,
    never a silent reconnect."""

    def __init__(self, redis_url: Optional[str], queue: str, namespace: str,
                 redis_client: Optional[R], limits: Limits, settings: dict[str, Any]) -> None:
        if redis_url is not None:
            settings["redis_url"] = redis_url
        self.config = ClientConfig(queue=queue, namespace=namespace, **settings)
        self.queue = queue
        self.namespace = namespace
        self.url = redact_url(self.config.redis_url)
        self._redis: Optional[R] = redis_client
        self._making = threading.Lock()
        self._closed = False
        self._builder = PayloadBuilder(Keys(namespace, queue), limits=limits)
        self._script = EnqueueScript(self.config.dedupe_ttl_s)
        self._queues: dict[str, QueueState] = {}
        self._script_loaded = False
        self._affinity = AffinityRouter(Keys(namespace, queue), self.config.affinity_ttl_s,
                                        self.config.affinity_max_backlog)

    # -- the Redis client
    def _make_redis(self) -> R:
        raise NotImplementedError

    @property
    def redis(self) -> R:
        """The Redis client; ClientClosed after ``close()`` (never a silent reconnect)."""
        if self._closed:
            raise ClientClosed(type(self).__name__)
        if self._redis is None:
            with self._making:              # two threads' first calls make one client
                if self._redis is None:
                    try:
                        self._redis = self._make_redis()
                    except NET_ERRORS as exc:   # asking the server whether it is a cluster node
                        raise RedisUnavailable(self.url, exc) from exc
        return self._redis

    @property
    def closed(self) -> bool:
        return self._closed

    # -- queues
    def _cached_queue(self, queue: Optional[str], fresh: bool) -> Optional[QueueState]:
        """The queue's state when known (and, with ``fresh``, not due for a re-read)."""
        st = self._queues.get(queue or self.queue)
        if st is None or (fresh and time.monotonic() >= st.expires):
            return None
        return st

    def _config_key(self, queue: Optional[str]) -> str:
        return Keys(self.namespace, queue or self.queue).config

    def _config_read(self, queue: Optional[str]) -> tuple[str, str, str]:
        """The HMGET (key, fields) that ``_store_queue`` wants the replies of."""
        return self._config_key(queue), LIMIT_FIELD, SHARDS_FIELD

    def _store_queue(self, queue: Optional[str], raw_limit: Any, raw_shards: Any) -> QueueState:
        """What the queue's config hash says, checked against what this client knew.

        The shard count is the client's ``shards`` (its own queue only) or the one the
        queue's workers registered, else 1; a registered count is kept for the client's life
        (a queue resharded under it raises ShardCountMismatch rather than sending jobs where
        no worker reads), while a count not registered yet follows a later registration."""
        name = queue or self.queue
        base = Keys(self.namespace, name)
        old = self._queues.get(name)
        registered = parse_shards(raw_shards, base.config)
        if registered is None and old is not None and old.registered:
            registered = old.keys.shards    # the field was deleted under a live client
        count = resolve_shards(self.config.shards if name == self.queue else None, registered,
                               base)
        if old is not None and old.registered and old.keys.shards != count:
            raise ShardCountMismatch(
                f"queue {name!r} was registered with {old.keys.shards} shards when this client "
                f"first used it and now with {count} ({base.config}): it was resharded; "
                f"create a new client")
        keys = old.keys if old is not None and old.keys.shards == count else \
            Keys(self.namespace, name, count)
        st = QueueState(keys, self._limit(raw_limit), registered is not None,
                        time.monotonic() + CONFIG_TTL_S)
        self._queues[name] = st
        return st

    def _limit(self, raw: Any) -> int:
        """The high-water mark: the client's own, else the config hash's, else the default."""
        if self.config.max_queued_jobs is not None:
            return self.config.max_queued_jobs
        try:
            return max(0, int(raw)) if raw is not None else DEFAULT_MAX_QUEUED_JOBS
        except ValueError:
            return DEFAULT_MAX_QUEUED_JOBS

    def _stale(self, queue: Optional[str]) -> None:
        """Read the queue's config again on next use (after this client changed it)."""
        st = self._queues.get(queue or self.queue)
        if st is not None:
            st.expires = 0.0

    # -- enqueue (shared bookkeeping)
    def _plan(self, prepared: list[Prepared], durable: Optional[bool]) -> EnqueuePlan:
        durable = self.config.durable if durable is None else durable
        return EnqueuePlan(prepared, self._script, self.config.chunk_size, durable)

    def _retrying(self) -> Retrying:
        return Retrying(self.config.reconnect_timeout_s if is_cluster(self._redis) else 0.0)

    def _wait_command(self, plan: EnqueuePlan) -> Optional[bytes]:
        """The trailer of a durable round: WAIT on each node that took writes."""
        if not plan.durable:
            return None
        return pack([b"WAIT", b"%d" % self.config.durable_replicas,
                             b"%d" % self.config.durable_timeout_ms])

    def _handle(self, job_cls: type, p: Prepared, known: bool) -> Any:
        st = self._queues[p.queue or self.queue]
        return job_cls(self, p.job_id, keys=st.keys, shard=p.shard, reattached=known)

    def _handles(self, job_cls: type, plan: EnqueuePlan, indexes: list[int]) -> list[Any]:
        return [self._handle(job_cls, plan.jobs[i], plan.entries[i][0]) for i in indexes]

    def _queue_full(self, job_cls: type, plan: EnqueuePlan) -> QueueFull:
        return QueueFull(plan.refused_queue(self.queue), plan.depth, plan.limit,
                         reason="oom" if plan.oom else "high-water mark",
                         accepted=self._handles(job_cls, plan, plan.accepted()))

    def _finish(self, job_cls: type, plan: EnqueuePlan) -> list[Any]:
        """The handles of a finished plan; NotDurable (carrying them) when a durable submit's
        jobs were acknowledged by fewer replicas than asked."""
        jobs = self._handles(job_cls, plan, list(range(len(plan.jobs))))
        if plan.durable:
            asked = self.config.durable_replicas
            acked, short = plan.short_of(asked)
            if short:
                errors = {str(a) for a in plan.acks if isinstance(a, Exception)}
                raise NotDurable(acked, asked, [plan.jobs[i].job_id for i in short], jobs,
                                 detail="; ".join(sorted(errors)))
        return jobs
