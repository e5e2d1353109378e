"""The synchronous producer client: submit, stream, cancel, bulk submit and map.

All enqueueing goes through one Lua script (``protocol.scripts.ENQUEUE``) that checks the queue's
high-water mark and sets the job's dedupe record together with the XADD, so retries never create a
second job; a queue of several shards gets one call per chunk of a shard, all sent in one round
trip per Redis node (``topology.send_packed``). Result streams are read with XREAD BLOCK from the
last entry id seen; many jobs share one XREAD (one per cluster slot in a Redis Cluster), so a
window of a thousand jobs costs one connection, not a thousand.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import redis
from redis.exceptions import NoScriptError

from producer_sdk._wire import (EnqueuePlan, QueueState, is_oom, is_transient,
                                merge_reads, merge_xreads, normalize_xread, parse_raw_xread,
                                sliced_xread, slot_groups)
from producer_sdk.client_core import (LIMIT_FIELD, NET_ERRORS, SEND_ERRORS, ClientCore, Retrying,
                                     make_redis)
from producer_sdk.errors import DUPLICATE, JobFailed, JobNotFound, RedisUnavailable
from producer_sdk.job import Deadline, Delta, Job, JobState, Result, feed_states
from producer_sdk.payloads import Prepared
from protocol.keys import Keys
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.scripts import ENQUEUE
from protocol.wire import now_ms, validate_job_id
from producer_sdk.status import JobStatus, Lockstep, liveness, status_plan
from protocol.topology import Packed, is_cluster, node_name, send_packed, send_packed_trailed

XREAD_COUNT = 512


def progress_bar(total: Optional[int], enabled: bool, desc: str) -> Any:
    """A tqdm bar (rate and ETA) or a no-op stand-in."""
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="job", dynamic_ncols=True)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def map_defaults(sampling: Mapping[str, Any], job_fields: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults for map(): results only, so stream=False unless token logprobs are wanted."""
    defaults = {**sampling, **job_fields}
    defaults.setdefault("stream", sampling.get("logprobs") is not None)
    return defaults


def take_batch(it: Iterator[Any], room: int) -> tuple[list[Any], bool]:
    """Up to ``room`` items from ``it`` (at least one when any is left), and whether ``it`` ran
    out: the in-flight window of ``iter_completed`` refills from a lazy source with this."""
    batch: list[Any] = []
    for item in it:
        batch.append(item)
        if len(batch) >= room:
            return batch, False
    return batch, True


class Client(ClientCore[redis.Redis]):
    """Producer client for one queue. Thread-safe; one Job may be read from several threads.

    ``limits`` are the protocol's payload limits (default ``DEFAULT_LIMITS``, what workers
    enforce unless configured otherwise): a job over one raises InvalidRequest before enqueue.
    ``redis_url`` may name one Redis server or any node of a Redis Cluster (``cluster=``,
    ``shards=`` and the other settings: ``ClientConfig``). After ``close()`` every use raises
    ClientClosed.
    """

    def __init__(self, redis_url: Optional[str] = None, queue: str = "default",
                 namespace: str = "tokenrelay", *, redis_client: Optional[Any] = None,
                 limits: Limits = DEFAULT_LIMITS, **settings: Any) -> None:
        super().__init__(redis_url, queue, namespace, redis_client, limits, settings)

    def _make_redis(self) -> Any:
        return make_redis(self.config)

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
        self._call(lambda: self.redis.ping())

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except NET_ERRORS as exc:
            raise RedisUnavailable(self.url, exc) from exc

    # -- queues
    def _queue(self, queue: Optional[str] = None, fresh: bool = False) -> QueueState:
        st = self._cached_queue(queue, fresh)
        if st is None:
            key, *fields = self._config_read(queue)
            st = self._store_queue(queue, *self._call(self.redis.hmget, key, fields))
        return st

    def keys_of(self, queue: Optional[str] = None) -> Keys:
        """The keys of ``queue`` (None: the client's), with its shard count: the client's
        ``shards`` or the one the queue's workers registered (read once), else 1."""
        return self._queue(queue).keys

    @property
    def keys(self) -> Keys:
        """The keys of the client's queue (``keys_of()``)."""
        return self.keys_of()

    # -- submit
    def submit(self, prompt: Optional[str] = None, *, messages: Optional[list[dict]] = None,
               prompt_token_ids: Optional[list[int]] = None, job_id: Optional[str] = None,
               priority: int = 0, deadline_s: Optional[float] = None, stream: bool = True,
               metadata: Optional[dict[str, Any]] = None, block: bool = False,
               block_timeout: Optional[float] = None,
               chat_template_kwargs: Optional[dict[str, Any]] = None,
               traceparent: Optional[str] = None, routing_key: Optional[str] = None,
               durable: Optional[bool] = None,
               **sampling: Any) -> Job:
        """Enqueue one job. Sampling fields are validated first (ValueError names a bad one).

        Raises QueueFull past the queue's high-water mark unless ``block`` (then waits up to
        ``block_timeout`` seconds), RedisUnavailable when Redis cannot be reached. Submitting a
        ``job_id`` that is already known returns a handle on the existing job.
        ``chat_template_kwargs`` (with ``messages``) are variables for the model's chat
        template, e.g. ``{"enable_thinking": False}`` for Qwen3. ``traceparent`` (W3C Trace
        Context) is carried with the job and logged by the worker with every line of it.
        ``routing_key`` (a conversation or system-prompt id, OpenAI's ``prompt_cache_key``)
        sends jobs with the same key to the same live worker, whose prefix cache holds what
        they share (producer_sdk/affinity.py); without it the job goes to the shared lanes.
        ``durable`` (default: the client's ``durable``) waits until ``durable_replicas``
        replicas acknowledged the enqueue, else raises NotDurable with the job enqueued.
        """
        prepared = self._builder.build(prompt, messages, prompt_token_ids, job_id=job_id,
                                       priority=priority, deadline_s=deadline_s, stream=stream,
                                       metadata=metadata,
                                       chat_template_kwargs=chat_template_kwargs,
                                       traceparent=traceparent, routing_key=routing_key,
                                       **sampling)
        return self.enqueue([prepared], block=block, block_timeout=block_timeout,
                            durable=durable)[0]

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
        prepared = self._builder.build_many(requests, defaults, now_ms())
        return self.enqueue(prepared, block=block, block_timeout=block_timeout, durable=durable)

    def prepare(self, request: Any, **defaults: Any) -> Prepared:
        """Validate and encode one request without sending it (for custom windows)."""
        return self._builder.build_request(request, defaults)

    def enqueue(self, prepared: Sequence[Prepared], *, block: bool,
                block_timeout: Optional[float] = None, durable: Optional[bool] = None) -> list[Job]:
        """Send prepared jobs; the core of submit/submit_many."""
        if not prepared:
            return []
        if not self._script_loaded:
            # Load once up front (on every master of a cluster): a NOSCRIPT reply would make
            # the first round travel twice.
            self._call(self.redis.script_load, ENQUEUE.source)
            self._script_loaded = True
        self._affinity.route(self.redis, prepared)
        plan = self._plan(list(prepared), durable)
        deadline = Deadline(block_timeout)
        retry = self._retrying()
        pause = 0.02
        while True:
            if plan.todo:
                failed = self._run_round(plan, retry)
                if failed is not None:      # a cluster failing over: wait, send the rest again
                    wait = retry.pause()
                    if wait is None:
                        raise RedisUnavailable(self.url, failed)
                    time.sleep(wait)
                continue
            if not plan.refused:
                break
            if not block or deadline.expired:
                raise self._queue_full(Job, plan)
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
            plan.requeue_refused()
        return self._finish(Job, plan)

    def _run_round(self, plan: EnqueuePlan, retry: Retrying) -> Optional[Exception]:
        """One enqueue round: the queues' config when due, the other shards' depth when the
        queue has several, then the script calls (and a durable submit's WAIT per node).
        Returns the error of calls a failing-over cluster refused (they are to be resent)."""
        states = {q: self._queue(q, fresh=True) for q in plan.queues()}
        plan.place(states)
        reads = plan.depth_reads(states)
        depths = self._send(reads, retry)[0] if reads else []
        cmds = plan.round(states, depths)
        replies, acks = self._send([c for _, c in cmds], retry, self._wait_command(plan))
        load, failed = False, None
        for (idx, _), rep, ack in zip(cmds, replies, acks):
            if isinstance(rep, NoScriptError):
                plan.resend(idx)
                load = True
            elif is_oom(rep):
                plan.refuse_oom(idx)
            elif is_transient(rep):
                plan.resend(idx)
                failed = rep
            elif isinstance(rep, Exception):
                raise rep
            else:
                plan.on_reply(idx, rep, ack)
        if load:
            self._call(self.redis.script_load, ENQUEUE.source)
        return failed

    def _send(self, items: list[Packed], retry: Retrying, trailer: Optional[bytes] = None,
              ) -> tuple[list[Any], list[Any]]:
        """``topology.send_packed_trailed``: one round trip per node. A dropped connection
        resends the whole batch (``retry`` says how long): the enqueue script is idempotent
        per job id, and XLEN and WAIT only read."""
        while True:
            try:
                return send_packed_trailed(self.redis, items, trailer)
            except SEND_ERRORS as exc:
                wait = retry.pause()
                if wait is None:
                    raise RedisUnavailable(self.url, exc) from exc
                time.sleep(wait)

    # -- jobs
    def get(self, job_id: str, queue: Optional[str] = None) -> Job:
        """Reattach to a job by id (e.g. from another process) of the client's queue or
        ``queue``. Raises JobNotFound."""
        validate_job_id(job_id)
        job = Job(self, job_id, keys=self.keys_of(queue), reattached=True)
        if self.probe([job])[0] == "unknown":
            raise JobNotFound(job_id)
        return job

    def probe(self, jobs: Sequence[Job]) -> list[str]:
        """Per job: 'active' (queued, running or has results), 'lost' or 'unknown' (see
        ``status.liveness``); marks lost jobs so reading them fails at once."""
        found = [liveness(s) for s in self._statuses([(j.keys, j.id, j.shard) for j in jobs],
                                                     position=False)]
        for j, state in zip(jobs, found):
            if state == "lost":
                j.state.mark_lost()
        return found

    def status(self, job_id: str, queue: Optional[str] = None) -> JobStatus:
        """Where a job (of the client's queue, or ``queue``) stands: queued (lane, approximate
        position), running (worker, tokens so far), done, cancelled, failed, expired or unknown
        (producer_sdk/status.py). Reads only: two round trips, four for a queued job."""
        return self.statuses([job_id], queue)[0]

    def statuses(self, job_ids: Sequence[str], queue: Optional[str] = None) -> list[JobStatus]:
        """``status`` of many jobs in the round trips of one (e.g. every line of a batch)."""
        for job_id in job_ids:
            validate_job_id(job_id)
        keys = self.keys_of(queue)
        return self._statuses([(keys, j, None) for j in job_ids])

    def _statuses(self, targets: Sequence[tuple[Keys, str, Optional[int]]],
                  position: bool = True) -> list[JobStatus]:
        lock = Lockstep([status_plan(k, j, s, position) for k, j, s in targets],
                        by_slot=is_cluster(self.redis))
        while (steps := lock.round()) is not None:
            lock.feed([self._call(s.pipeline(self.redis).execute, False) for s in steps])
        return lock.results

    def cancel(self, job_id: str, queue: Optional[str] = None) -> None:
        """Set the job's cancel flag (with a TTL); idempotent, works for unknown ids too."""
        self._cancel_keys([self.keys_of(queue).cancel(job_id)])

    def _cancel_keys(self, keys: list[str]) -> None:
        if len(keys) == 1:
            self._call(self.redis.set, keys[0], b"1", ex=self.config.cancel_ttl_s)
            return
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.set(key, b"1", ex=self.config.cancel_ttl_s)
        self._call(pipe.execute)

    def queue_depth(self, queue: Optional[str] = None) -> int:
        """Jobs queued or in flight across the lanes of every shard (acknowledged entries are
        deleted)."""
        pipe = self.redis.pipeline(transaction=False)
        for lane in self.keys_of(queue).lanes():
            pipe.xlen(lane)
        return sum(self._call(pipe.execute))

    def set_max_queued_jobs(self, limit: int, queue: Optional[str] = None) -> None:
        """Set the queue's shared high-water mark (for every producer without its own)."""
        self._call(self.redis.hset, self._config_key(queue), LIMIT_FIELD, int(limit))
        self._stale(queue)

    # -- reading results
    def _xread(self, streams: dict[str, bytes], block_ms: int) -> list:
        """XREAD BLOCK that survives dropped connections for up to reconnect_timeout_s. Streams
        in several cluster slots are read per slot (``_wire.sliced_xread``)."""
        give_up = time.monotonic() + self.config.reconnect_timeout_s
        pause = 0.05
        while True:
            try:
                return self._xread_once(streams, block_ms)
            except NET_ERRORS as exc:
                if time.monotonic() >= give_up:
                    raise RedisUnavailable(self.url, exc) from exc
                time.sleep(pause)
                pause = min(pause * 2, 1.0)

    def _xread_once(self, streams: dict[str, bytes], block_ms: int) -> list:
        r = self.redis
        if len(streams) == 1:
            return normalize_xread(r.xread(streams, count=XREAD_COUNT, block=block_ms))
        if not is_cluster(r) or len(slot_groups(streams)) == 1:
            pipe = r.pipeline(transaction=False)
            pipe.xread(streams, count=XREAD_COUNT, block=block_ms)
            pipe.xread(streams, count=XREAD_COUNT)
            return merge_xreads(*pipe.execute())
        end = time.monotonic() + block_ms / 1000
        while True:
            items = sliced_xread(streams, lambda k: node_name(r, k), XREAD_COUNT, block_ms)
            got = merge_reads(parse_raw_xread(x) for x in send_packed(r, items))
            left_ms = int((end - time.monotonic()) * 1000)
            if got or left_ms <= 0:
                return got
            block_ms = left_ms

    def _pump(self, states: Iterable[JobState], block_ms: int) -> list[tuple[JobState, list[Delta]]]:
        """One XREAD over several jobs; feeds each job the entries read for it."""
        by_key = {s.key: s for s in states if not s.finished}
        if not by_key:
            return []
        return feed_states(by_key, self._xread({k: s.last_id for k, s in by_key.items()},
                                               block_ms), XREAD_COUNT)

    def _pump_one(self, state: JobState, deadline: Deadline) -> list[Delta]:
        got = self._pump([state], deadline.block_ms(self.config.poll_ms))
        return got[0][1] if got else []

    def iter_completed(self, source: Iterable[tuple[Any, Prepared]], *, concurrency: int = 64,
                       block: bool = True, cancel_on_exit: bool = True,
                       on_submitted: Optional[Callable[[list[tuple[Any, Job]]], None]] = None,
                       durable: Optional[bool] = None) -> Iterator[tuple[Any, Job]]:
        """Run (tag, prepared job) pairs with at most ``concurrency`` in flight; yield finished
        (tag, Job) pairs as they complete. ``source`` is pulled lazily (bounded memory).

        Already-known job ids reattach instead of resubmitting; those whose results expired come
        back finished with a 'lost' JobFailed. With ``cancel_on_exit`` the jobs still in flight
        are cancelled when the consumer stops early or raises. ``durable``: every enqueue
        waits for replicas (NotDurable ends the run; its jobs stay enqueued).
        """
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        it = iter(source)
        inflight: dict[str, tuple[Any, Job]] = {}
        exhausted = False
        try:
            while True:
                if not exhausted and len(inflight) < concurrency:
                    batch, exhausted = take_batch(it, concurrency - len(inflight))
                    yield from self._start(batch, inflight, block, on_submitted, durable)
                if not inflight:
                    if exhausted:
                        return
                    continue
                for state, _ in self._pump([j.state for _, j in inflight.values()],
                                           self.config.poll_ms):
                    if state.finished:
                        yield inflight.pop(state.key)
        finally:
            if cancel_on_exit and inflight:
                self._cancel_many([j for _, j in inflight.values()])

    def _start(self, batch: list[tuple[Any, Prepared]], inflight: dict[str, tuple[Any, Job]],
               block: bool, on_submitted: Optional[Callable],
               durable: Optional[bool] = None) -> Iterator[tuple[Any, Job]]:
        if not batch:
            return
        jobs = self.enqueue([p for _, p in batch], block=block, durable=durable)
        pairs = [(tag, job) for (tag, _), job in zip(batch, jobs)]
        reattached = [j for _, j in pairs if j.reattached]
        if reattached:
            self.probe(reattached)
        if on_submitted:
            on_submitted(pairs)
        for tag, job in pairs:
            if job.state.finished:
                yield tag, job
            elif job.state.key in inflight:
                job.state.fail(DUPLICATE, f"job id {job.id} is already in flight in this "
                               f"window (duplicate request id)")
                yield tag, job
            else:
                inflight[job.state.key] = (tag, job)

    def _cancel_many(self, jobs: list[Job]) -> None:
        try:
            self._cancel_keys([j.cancel_key for j in jobs])
        except RedisUnavailable:
            pass  # best effort while unwinding; the original exception matters more

    def map(self, prompts_or_requests: Iterable[Any], *, concurrency: int = 32,
            progress: bool = True, return_exceptions: bool = False, priority: int = 0,
            block: bool = True, durable: Optional[bool] = None, **sampling: Any) -> list[Any]:
        """Run every prompt (or submit() kwargs dict) and return Results in input order.

        At most ``concurrency`` jobs are queued or running at once. A failed job raises JobFailed
        (cancelling the rest) unless ``return_exceptions``, which puts the JobFailed in its slot.
        """
        defaults = map_defaults(sampling, {"priority": priority})
        results: list[Any] = []
        bar = progress_bar(_len_or_none(prompts_or_requests), progress, "map")

        def source() -> Iterator[tuple[int, Prepared]]:
            for i, req in enumerate(prompts_or_requests):
                results.append(None)
                yield i, self._builder.build_request(req, defaults)

        try:
            for i, job in self.iter_completed(source(), concurrency=concurrency, block=block,
                                              durable=durable):
                results[i] = _outcome(job.state, return_exceptions)
                bar.update(1)
        finally:
            bar.close()
        return results


def _len_or_none(x: Any) -> Optional[int]:
    try:
        return len(x)
    except TypeError:
        return None


def _outcome(state: JobState, return_exceptions: bool) -> Any:
    try:
        return state.result()
    except JobFailed as exc:
        if return_exceptions:
            return exc
        raise


__all__ = ["Client", "Job", "Result", "Delta"]
