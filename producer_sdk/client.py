"""The synchronous producer client: submit, stream, cancel, bulk submit and map.

Every operation is a plan of ``ClientCore`` (producer_sdk/core/client_core.py), shared with
``AsyncClient``; this class runs them blocking (``effects.run``) and turns a connection error
that leaves a plan into RedisUnavailable. How a job is enqueued: producer_sdk/core/enqueue.py; how
results are read: producer_sdk/core/reads.py.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, TypeVar

import redis

from tokenrelay.producer_sdk.jobs import signatures
from tokenrelay.producer_sdk.core.client_core import NET_ERRORS, ClientCore, make_redis
from tokenrelay.producer_sdk.core.effects import Plan, run
from tokenrelay.producer_sdk.errors import RedisUnavailable
from tokenrelay.producer_sdk.jobs.job import Delta, Job, Result
from tokenrelay.producer_sdk.jobs.payloads import Prepared
from tokenrelay.producer_sdk.core.status import JobStatus
from tokenrelay.producer_sdk.core.window import MapRun, Window, map_defaults
from tokenrelay.protocol.keys import Keys
from tokenrelay.protocol.limits import DEFAULT_LIMITS, Limits

T = TypeVar("T")


class Client(ClientCore[redis.Redis]):
    """Producer client for one queue. Thread-safe; one Job may be read from several threads.

    ``limits`` are the protocol's payload limits (default ``DEFAULT_LIMITS``, what workers
    enforce unless configured otherwise): a job over one raises InvalidRequest before enqueue.
    ``redis_url`` may name one Redis server or any node of a Redis Cluster (``cluster=``,
    ``shards=`` and the other settings: ``ClientConfig``). After ``close()`` every use raises
    ClientClosed.
    """

    job_class = Job

    def __init__(self, redis_url: Optional[str] = None, queue: str = "default",
                 namespace: str = "tokenrelay", *, redis_client: Optional[Any] = None,
                 limits: Limits = DEFAULT_LIMITS, **settings: Any) -> None:
        super().__init__(redis_url, queue, namespace, redis_client, limits, settings)

    def _make_redis(self) -> Any:
        return make_redis(self.config)

    def _run(self, plan: Plan[T]) -> T:
        """Run a plan on this client's Redis, blocking."""
        try:
            return run(plan, lambda: self.redis)
        except NET_ERRORS as exc:
            raise RedisUnavailable(self.url, exc) from exc

    # -- lifecycle
    def close(self) -> None:
        """Close the connections. Any later use raises ClientClosed; closing twice is fine."""
        if not self._closed:
            self._closed = True
            if self._redis is not None:
                self._redis.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def ping(self) -> None:
        """Raise RedisUnavailable unless Redis answers."""
        self._run(self._ping())

    def live_workers(self, queue: Optional[str] = None) -> list[str]:
        """Ids of the live workers that take new jobs of the client's queue (or ``queue``):
        empty means a job submitted now waits until one starts."""
        return self._run(self._live_workers(queue))

    def queue_of_model(self, model: str) -> str:
        """The queue live workers serve ``model`` on (what ``submit(model=...)`` routes to);
        ModelNotFound, listing the served models, when no live worker serves it."""
        return self._run(self._queue_of_model(model))

    # -- queues
    def keys_of(self, queue: Optional[str] = None) -> Keys:
        """The keys of ``queue`` (None: the client's), with its shard count: the client's
        ``shards`` or the one the queue's workers registered (read once), else 1."""
        return self._run(self._keys_of(queue))

    @property
    def keys(self) -> Keys:
        """The keys of the client's queue (``keys_of()``)."""
        return self.keys_of()

    def queue_depth(self, queue: Optional[str] = None) -> int:
        """Jobs queued or in flight across the lanes of every shard (acknowledged entries are
        deleted)."""
        return self._run(self._queue_depth(queue))

    def set_max_queued_jobs(self, limit: int, queue: Optional[str] = None) -> None:
        """Set the queue's shared high-water mark (for every producer without its own)."""
        self._run(self._set_max_queued_jobs(limit, queue))

    def set_max_queued_tokens(self, limit: int, queue: Optional[str] = None) -> None:
        """Set the queue's shared token budget (for every producer without its own; 0: none)."""
        self._run(self._set_max_queued_tokens(limit, queue))

    # -- submit
    @signatures.same_signature(signatures.submit)
    def submit(self, *args: Any, **kwargs: Any) -> Job:
        return self._run(self._submit(args, kwargs))

    def submit_many(self, requests: Iterable[Any], *, block: bool = True,
                    block_timeout: Optional[float] = None, durable: Optional[bool] = None,
                    **defaults: Any) -> list[Job]:
        """Enqueue many jobs in pipelined script calls; returns Jobs in input order.

        Each request is a prompt string or a dict of submit() keyword arguments; ``defaults``
        (sampling fields, priority, stream, ...) apply to every request that does not override
        them. Everything is validated before the first job is sent. Bulk default: ``block=True``
        waits for room; with ``block=False`` QueueFull carries the jobs that did go in.
        ``durable`` as for submit (NotDurable names the jobs short of replicas).
        """
        return self._run(self._submit_many(requests, block, block_timeout, durable, defaults))

    def enqueue(self, prepared: Sequence[Prepared], *, block: bool,
                block_timeout: Optional[float] = None, durable: Optional[bool] = None) -> list[Job]:
        """Send prepared jobs (``prepare``); the core of submit/submit_many."""
        return self._run(self._enqueue(prepared, block=block, block_timeout=block_timeout,
                                       durable=durable))

    # -- jobs
    def get(self, job_id: str, queue: Optional[str] = None) -> Job:
        """Reattach to a job by id (e.g. from another process) of the client's queue or
        ``queue``. Raises JobNotFound."""
        return self._run(self._get(job_id, queue))

    def probe(self, jobs: Sequence[Job]) -> list[str]:
        """Per job: 'active' (queued, running or has results), 'lost' or 'unknown' (see
        ``status.liveness``); marks lost jobs so reading them fails at once."""
        return self._run(self._probe(jobs))

    def status(self, job_id: str, queue: Optional[str] = None) -> JobStatus:
        """Where a job (of the client's queue, or ``queue``) stands: queued (lane, approximate
        position), running (worker, tokens so far), done, cancelled, failed, expired or unknown
        (producer_sdk/core/status.py). Reads only: two round trips, four for a queued job."""
        return self.statuses([job_id], queue)[0]

    def statuses(self, job_ids: Sequence[str], queue: Optional[str] = None) -> list[JobStatus]:
        """``status`` of many jobs in the round trips of one (e.g. every line of a batch)."""
        return self._run(self._statuses(job_ids, queue))

    def cancel(self, job_id: str, queue: Optional[str] = None) -> None:
        """Set the job's cancel flag (idempotent; it expires with the job's records).
        JobNotFound, with nothing written, when Redis holds no record of ``job_id`` (never
        submitted to ``queue``, or expired): no flag is left to cancel a later job of that
        id."""
        self._run(self._cancel(job_id, queue))

    # -- many jobs at once
    def iter_completed(self, source: Iterable[tuple[Any, Prepared]], *, concurrency: int = 64,
                       block: bool = True, cancel_on_exit: bool = True,
                       on_submitted: Optional[Callable[[list[tuple[Any, Job]]], None]] = None,
                       durable: Optional[bool] = None) -> Iterator[tuple[Any, Job]]:
        """Run (tag, prepared job) pairs with at most ``concurrency`` in flight; yield finished
        (tag, Job) pairs as they complete. ``source`` is pulled lazily (bounded memory).

        Already-known job ids reattach instead of resubmitting; those whose results expired come
        back finished with a 'lost' JobFailed. With ``cancel_on_exit`` the jobs still in flight
        are cancelled when the consumer stops early or raises. ``on_submitted`` sees each
        enqueued batch's pairs. ``durable``: every enqueue waits for replicas (NotDurable ends
        the run; its jobs stay enqueued).
        """
        window = Window(self, source, concurrency, block, durable, self.config.poll_ms,
                        on_submitted)
        try:
            while not window.over:
                yield from self._run(window.refill())
                yield from self._run(window.read())
        finally:
            if cancel_on_exit:
                self._run(window.cancel_rest())

    def map(self, prompts_or_requests: Iterable[Any], *, concurrency: int = 32,
            progress: bool = True, return_exceptions: bool = False, priority: int = 0,
            block: bool = True, durable: Optional[bool] = None, **sampling: Any) -> list[Any]:
        """Run every prompt (or submit() kwargs dict) and return Results in input order.

        At most ``concurrency`` jobs are queued or running at once. A failed job raises JobFailed
        (cancelling the rest) unless ``return_exceptions``, which puts the JobFailed in its slot.
        """
        with MapRun(self._builder.build_request, prompts_or_requests,
                    map_defaults(sampling, {"priority": priority}), progress,
                    return_exceptions) as run_:
            for i, job in self.iter_completed(run_.source(), concurrency=concurrency,
                                              block=block, durable=durable):
                run_.done(i, job)
        return run_.results


__all__ = ["Client", "Job", "Result", "Delta"]
