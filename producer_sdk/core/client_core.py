"""The SDK's sans-IO core: everything the sync and async producer clients do, written once.

``ClientCore`` holds what a client owns (its settings, the Redis client, made on first use, the
queues it knows, the payload builder, the enqueue and the result reader) and writes each
operation as a plan (the plan style and its two drivers: ``effects``): it says which commands
to send and what their replies mean. Its parts have one module each: enqueueing (``enqueue``),
reading result streams (``reads``), what a producer knows of a queue and its depth
(``queues``). ``Client`` runs the plans blocking, ``AsyncClient`` awaiting; neither holds any
other logic, so a fix made here is made for both.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from typing import Any, Generic, Iterable, Mapping, Optional, Sequence, TypeVar

from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.asyncio.retry import Retry as AsyncRetry
from redis.retry import Retry

from tokenrelay.producer_sdk.core.affinity import AffinityRouter
from tokenrelay.producer_sdk.config import ClientConfig
from tokenrelay.producer_sdk.core.effects import (NET_ERRORS, SEND_ERRORS, Call, Plan, Send, Sleep,
                                  raise_transient, retrying, run_plan_script)
from tokenrelay.producer_sdk.core.enqueue import EnqueuePlan, Enqueuer
from tokenrelay.producer_sdk.errors import (ClientClosed, InvalidRequest, JobNotFound, NotDurable,
                                            QueueFull, RedisUnavailable, SDKError)
from tokenrelay.producer_sdk.jobs.job import Deadline, JobHandle, JobState
from tokenrelay.producer_sdk.core.models import ServedModel, listing, resolve_model
from tokenrelay.producer_sdk.core.models import live_workers as queue_workers
from tokenrelay.producer_sdk.jobs.payloads import PayloadBuilder, Prepared, gc_paused
from tokenrelay.producer_sdk.core.queues import LIMIT_FIELD, TOKENS_FIELD, QueueBook
from tokenrelay.producer_sdk.core.reads import Lost, Pumped, ResultReader, rerun_request
from tokenrelay.producer_sdk.jobs.signatures import SEND_OPTIONS, bind_submit
from tokenrelay.producer_sdk.core.status import JobStatus, liveness, read_statuses
from tokenrelay.protocol.keys import Keys
from tokenrelay.protocol.limits import Limits
from tokenrelay.protocol.scripts import CANCEL_KNOWN, FORGET_STALE_RECORD, CancelTarget, cancel_target, pack
from tokenrelay.protocol.topology import Packed, make_async_client, make_client, redact_url
from tokenrelay.protocol.wire import now_ms, validate_job_id

__all__ = ["NET_ERRORS", "SEND_ERRORS", "LIMIT_FIELD", "ClientCore",
           "make_redis", "make_async_redis"]

log = logging.getLogger("producer_sdk")
MAX_RERUNS = 3      # times a reader puts one lost job back in its queue before it gives up


def connection_kwargs(cfg: ClientConfig, asyncio: bool = False) -> dict[str, Any]:
    """A short connect timeout and one retry on a fresh connection: fail fast, not hang, and
    a pooled connection a restarted server closed is replaced, not answered as an error.
    (An asyncio client needs the asyncio Retry: the sync one does not retry awaited calls.)"""
    retry = (AsyncRetry if asyncio else Retry)(ExponentialBackoff(cap=0.5, base=0.05), 1)
    return dict(socket_connect_timeout=cfg.connect_timeout_s, socket_timeout=cfg.socket_timeout_s,
                socket_keepalive=True, retry=retry,
                retry_on_error=[RedisConnectionError, RedisTimeoutError])


def make_redis(cfg: ClientConfig, cluster: Optional[bool] = None) -> Any:
    """A sync client for ``cfg``: a Redis Cluster client when the server is a cluster node
    (``cfg.cluster`` None asks it; ``cluster`` given: already known), else redis.Redis."""
    known = cfg.cluster if cluster is None else cluster
    return make_client(cfg.redis_url, known, **connection_kwargs(cfg))


def make_async_redis(cfg: ClientConfig, cluster: Optional[bool] = None) -> Any:
    """``make_redis`` for asyncio (detection, when needed, is one short blocking call), with a
    bounded pool of ``max_connections`` that waits up to ``pool_timeout_s`` for a free one
    (redis-py's default pool raises at once when it is empty)."""
    known = cfg.cluster if cluster is None else cluster
    return make_async_client(cfg.redis_url, known, max_connections=cfg.max_connections,
                             pool_timeout_s=cfg.pool_timeout_s,
                             **connection_kwargs(cfg, asyncio=True))


R = TypeVar("R")


def _needs_route(fields: Mapping[str, Any]) -> bool:
    """Whether submit() arguments name a ``model`` and leave its queue to be found."""
    return fields.get("model") is not None and fields.get("queue") is None


class ClientCore(ABC, Generic[R]):
    """What a producer client over Redis client ``R`` does, as plans; a subclass runs them.

    The Redis client is made on first use (asking a server whether it is a cluster node is
    I/O, and a client is made before Redis may be up); after ``close()`` every use raises
    ClientClosed, never a silent reconnect. ``job_class`` is the handle the subclass returns.
    """

    job_class: type[JobHandle] = JobHandle

    def __init__(self, redis_url: Optional[str], queue: str, namespace: str,
                 redis_client: Optional[R], limits: Limits, settings: dict[str, Any]) -> None:
        if redis_url is not None:
            settings["redis_url"] = redis_url
        cfg = self.config = ClientConfig(queue=queue, namespace=namespace, **settings)
        self.queue = queue
        self.namespace = namespace
        self.url = redact_url(cfg.redis_url)
        self._redis: Optional[R] = redis_client
        self._making = threading.Lock()
        self._closed = False
        self._builder = PayloadBuilder(Keys(namespace, queue), limits=limits,
                                       context_tokens=cfg.context_tokens,
                                       producer=cfg.producer)
        self._queues = QueueBook(namespace, queue, cfg.shards, cfg.max_queued_jobs,
                                 cfg.max_queued_tokens)
        self._affinity = AffinityRouter(Keys(namespace, queue), cfg.affinity_ttl_s,
                                        cfg.affinity_max_backlog)
        self._enqueuer = Enqueuer(self._queues, self._affinity, cfg, self.url)
        self._reader = ResultReader(cfg.poll_ms, cfg.reconnect_timeout_s, self.url,
                                    cfg.lost_check_s, cfg.deadline_grace_s)

    # -- the Redis client
    @abstractmethod
    def _make_redis(self) -> R:
        """A new Redis client for ``config`` (sync or asyncio: the subclass's)."""

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

    def prepare(self, request: Any, **defaults: Any) -> Prepared:
        """Validate and encode one request without sending it (for custom windows)."""
        return self._builder.build_request(request, defaults)

    # -- plans: submit
    def _submit(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Plan[Any]:
        fields = bind_submit(args, kwargs)
        block, block_timeout, durable = (fields.pop(k) for k in SEND_OPTIONS)
        if _needs_route(fields):
            fields = self._routed(fields, (yield from self._models()))
        prepared = self._builder.build(**fields)
        return (yield from self._enqueue([prepared], block=block, block_timeout=block_timeout,
                                         durable=durable))[0]

    def _submit_many(self, requests: Iterable[Any], block: bool, block_timeout: Optional[float],
                     durable: Optional[bool], defaults: dict[str, Any]) -> Plan[list[Any]]:
        requests = requests if type(requests) is list else list(requests)
        if _needs_route(defaults) or any(isinstance(r, Mapping) and _needs_route(r)
                                         for r in requests):
            models = yield from self._models()
            defaults = self._routed(defaults, models)
            requests = [self._routed(r, models) if isinstance(r, Mapping) and _needs_route(r)
                        else r for r in requests]
        with gc_paused():
            prepared = self._builder.build_many(requests, defaults, now_ms())
        return (yield from self._enqueue(prepared, block=block, block_timeout=block_timeout,
                                         durable=durable))

    def _models(self) -> Plan[dict[str, ServedModel]]:
        """The live models of the namespace (``producer_sdk.core.models``), read now."""
        return (yield from self._retrying(lambda: listing(self.namespace)))

    def _queue_of_model(self, model: str) -> Plan[str]:
        return resolve_model((yield from self._models()), model).queue

    def _routed(self, fields: Mapping[str, Any], models: dict[str, ServedModel]
                ) -> dict[str, Any]:
        """``fields`` with the queue their ``model`` is served on (as the gateway and the batch
        runner route): ModelNotFound when no live worker serves it. An explicit ``queue``
        wins; the worker still checks the model (a job is never answered by another)."""
        out = dict(fields)
        if not _needs_route(out):
            return out
        model = out["model"]
        if not isinstance(model, str):
            raise InvalidRequest(f"model must be a served model's name (a string), got "
                                 f"{type(model).__name__}", field="model")
        queue = resolve_model(models, model).queue
        out["queue"] = None if queue == self.queue else queue
        return out

    def _enqueue(self, prepared: Sequence[Prepared], *, block: bool,
                 block_timeout: Optional[float] = None,
                 durable: Optional[bool] = None) -> Plan[list[Any]]:
        """Send prepared jobs; their handles in input order. QueueFull carries the jobs that
        went in; NotDurable (a durable enqueue short of replicas) all of them."""
        # A cluster failing over answers the config, routing and script reads around the
        # rounds (which retry by themselves) with CLUSTERDOWN / TRYAGAIN / MOVED too: the whole
        # plan is run again then, safely (the script dedupes by job id); connection errors keep
        # the enqueuer's own policy (fail fast on one Redis).
        batch = yield from retrying(
            lambda: self._enqueuer.plan(prepared, block, block_timeout, durable),
            self.config.reconnect_timeout_s, self.url, connection=False)
        if batch.refused:
            raise QueueFull(batch.refused_queue(self.queue), batch.depth, batch.limit,
                            reason=batch.refusal(), accepted=self._handles(batch, batch.accepted()),
                            tokens=batch.tokens, token_limit=batch.token_limit)
        jobs = self._handles(batch, list(range(len(batch.jobs))))
        if batch.durable:
            asked = self.config.durable_replicas
            acked, short = batch.short_of(asked)
            if short:
                errors = {str(a) for a in batch.acks if isinstance(a, Exception)}
                raise NotDurable(acked, asked, [batch.jobs[i].job_id for i in short], jobs,
                                 detail="; ".join(sorted(errors)))
        return jobs

    def _handles(self, batch: EnqueuePlan, indexes: list[int]) -> list[Any]:
        with gc_paused():           # one handle per job, all kept: see gc_paused
            return self._make_handles(batch, indexes)

    def _make_handles(self, batch: EnqueuePlan, indexes: list[int]) -> list[Any]:
        out = []
        keys_of: dict[Optional[str], Keys] = {}
        make, entries, jobs = self.job_class.enqueued, batch.entries, batch.jobs
        for i in indexes:
            p = jobs[i]
            keys = keys_of.get(p.queue)
            if keys is None:
                keys = keys_of[p.queue] = self._queues.cached(p.queue).keys
            out.append(make(self, p.job_id, keys, p.shard, entries[i][0], p))
        return out

    # -- plans: jobs by id
    def _keys_of(self, queue: Optional[str]) -> Plan[Keys]:
        return (yield from self._queues.keys(queue))

    def _get(self, job_id: str, queue: Optional[str]) -> Plan[Any]:
        validate_job_id(job_id)
        job = self.job_class(self, job_id, keys=(yield from self._queues.keys(queue)),
                             reattached=True)
        if (yield from self._probe([job]))[0] == "unknown":
            raise JobNotFound(job_id, job.keys.queue, self.namespace)
        return job

    def _probe(self, jobs: Sequence[JobHandle]) -> Plan[list[str]]:
        """Per job: 'active' (queued, running or has results), 'lost' or 'unknown' (see
        ``status.liveness``); marks lost jobs so reading them fails at once."""
        statuses = yield from read_statuses([(j.keys, j.id, j.shard) for j in jobs],
                                            position=False)
        found = [liveness(s) for s in statuses]
        for j, state in zip(jobs, found):
            if state == "lost":
                j.state.mark_lost()
        return found

    def _statuses(self, job_ids: Sequence[str], queue: Optional[str]) -> Plan[list[JobStatus]]:
        for job_id in job_ids:
            validate_job_id(job_id)
        keys = yield from self._queues.keys(queue)
        return (yield from self._retrying(
            lambda: read_statuses([(keys, j, None) for j in job_ids])))

    def _cancel(self, job_id: str, queue: Optional[str]) -> Plan[None]:
        """Cancel one job by id; JobNotFound (nothing written) when Redis holds none of its
        records."""
        validate_job_id(job_id)
        keys = yield from self._queues.keys(queue)
        if not (yield from self._cancel_jobs([cancel_target(keys, job_id)]))[0]:
            raise JobNotFound(job_id, keys.queue, self.namespace)

    def _cancel_jobs(self, targets: Sequence[CancelTarget]) -> Plan[list[bool]]:
        """Set each job's cancel flag with ``CANCEL_KNOWN`` (only for a job whose records
        exist, expiring with them); per target, whether it was set. One pipeline, sent again
        through a lost connection or a failover (``_retrying``): a cancel is never dropped
        while Redis can still be reached."""
        ttl = b"%d" % self.config.cancel_ttl_s
        sha = CANCEL_KNOWN.sha.encode()

        def packed(t: CancelTarget) -> Packed:
            return (t.flag, pack((b"EVALSHA", sha, b"%d" % len(t), *t, ttl)), 1)

        def send() -> Plan[list[bool]]:
            replies, _ = yield Send([packed(t) for t in targets])
            missing = [i for i, x in enumerate(replies) if isinstance(x, NoScriptError)]
            if missing:     # a restarted or flushed script cache (SCRIPT LOAD: the producer
                # ACL rule grants no EVAL): load it, send those once more
                yield Call(lambda r: r.script_load(CANCEL_KNOWN.source))
                again, _ = yield Send([packed(targets[i]) for i in missing])
                for i, reply in zip(missing, again):
                    replies[i] = reply
            for reply in raise_transient(replies):
                if isinstance(reply, Exception):
                    raise reply
            return [int(x) == 1 for x in replies]

        if not targets:
            return []
        return (yield from self._retrying(send))

    def _retrying(self, make: Any) -> Plan[Any]:
        """``effects.retrying`` with this client's window: for plans safe to run again."""
        return (yield from retrying(make, self.config.reconnect_timeout_s, self.url))

    # -- plans: queues
    def _ping(self) -> Plan[None]:
        yield Call(lambda r: r.ping())

    def _live_workers(self, queue: Optional[str]) -> Plan[list[str]]:
        """Ids of the workers that take new jobs of ``queue`` now (``producer_sdk.core.models``:
        heartbeat fresh, engine loaded, not draining)."""
        name = queue or self.queue
        return (yield from self._retrying(
            lambda: queue_workers(self.namespace, name)))

    def _queue_depth(self, queue: Optional[str]) -> Plan[int]:
        lanes = (yield from self._queues.keys(queue)).lanes()

        def xlen_all(r: Any) -> Any:
            pipe = r.pipeline(transaction=False)
            for lane in lanes:
                pipe.xlen(lane)
            return pipe.execute()
        return sum((yield Call(xlen_all)))

    def _set_max_queued_jobs(self, limit: int, queue: Optional[str]) -> Plan[None]:
        yield from self._queues.set_limit(limit, queue)

    def _set_max_queued_tokens(self, limit: int, queue: Optional[str]) -> Plan[None]:
        yield from self._queues.set_limit(limit, queue, TOKENS_FIELD)

    # -- plans: results
    def _pump(self, states: Iterable[JobState], block_ms: int) -> Plan[Pumped]:
        """One read over ``states``, then what the reader decides by itself (``_settle``);
        every job that got entries or ended, with its new deltas."""
        states = [s for s in states if not s.finished]
        got = yield from self._reader.pump(states, block_ms)
        ended = yield from self._settle(states)
        return got + [(s, []) for s in ended if all(s is not g for g, _ in got)]

    def _pump_one(self, state: JobState, deadline: Deadline) -> Plan[list]:
        got = yield from self._pump([state], deadline.block_ms(self.config.poll_ms))
        return got[0][1] if got else []

    def _settle(self, states: Sequence[JobState]) -> Plan[list[JobState]]:
        """What waiting readers decide without a worker (``producer_sdk/core/reads.py``): jobs no
        worker started by their deadline are cancelled and end ``expired``; jobs whose
        records Redis lost go back in their queue from the request (``rerun_request``), or
        end ``job_lost`` when the reader has none (a job reattached by id). Returns the jobs
        that ended here."""
        ended = []
        overdue = self._reader.overdue(states)
        if overdue:
            yield from self._cancel_jobs([s.cancel_target for s in overdue if s.cancel_target])
            for s in overdue:
                s.expire()
            ended.extend(overdue)
        for lost in (yield from self._reader.check_lost(self._reader.loss_due(states))):
            yield from self._rerun(lost)
            if lost.state.finished:
                ended.append(lost.state)
        return ended

    def _rerun(self, lost: Lost) -> Plan[None]:
        """Put a lost job back in its queue under its id (letting go of a stale record that
        still names it first), or end it ``job_lost``."""
        state = lost.state
        if state.request is None:
            state.lose("Redis no longer holds this job (a restart without its data, or a "
                       "failover that lost it: no entry of it is queued or held) and this "
                       "reader does not hold its request to enqueue it again; resubmit it")
            return
        if state.reruns >= MAX_RERUNS:
            state.lose(f"Redis lost this job {state.reruns + 1} times; not enqueuing it again")
            return
        if lost.record is not None:
            args = ([state.dedupe_key, lost.lane], [lost.record, lost.entry])
            if not (yield from self._retrying(lambda: run_plan_script(FORGET_STALE_RECORD,
                                                                      *args))):
                return                  # the record changed under us: not stale after all
            yield Sleep(0.005)          # the record expires 1 ms after that
        try:
            yield from self._enqueue([rerun_request(state.request, state.token_seed
                                                          if state.token_seed is not None
                                                          else state.seed)], block=False)
        except (SDKError, ValueError) as exc:
            state.lose(f"Redis lost this job and enqueuing it again failed: {exc}")
            return
        log.warning("job %s: Redis lost it; enqueued again under the same id (rerun %d)",
                    state.job_id, state.reruns + 1)
        state.rerun()
