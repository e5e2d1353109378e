"""The synchronous producer client: submit, stream, cancel, bulk submit and map.

All enqueueing goes through one Lua script (``_wire.ENQUEUE_LUA``) that checks the queue's
high-water mark and sets the job's dedupe record together with the XADD, so retries never create a
second job. Result streams are read with XREAD BLOCK from the last entry id seen; many jobs share
one XREAD, so a window of a thousand jobs costs one connection, not a thousand.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import redis
from redis.exceptions import NoScriptError

from producer_sdk._wire import ENQUEUE_LUA, EnqueuePlan, is_oom, merge_xreads, normalize_xread
from producer_sdk.client_core import NET_ERRORS, ClientCore
from producer_sdk.errors import DUPLICATE, JobFailed, JobNotFound, QueueFull, RedisUnavailable
from producer_sdk.job import Deadline, Delta, Job, JobState, Result, feed_states
from producer_sdk.payloads import Prepared
from producer_sdk.protocol import DEFAULT_LIMITS, Limits, now_ms, validate_job_id
from producer_sdk.status import JobStatus, Lockstep, liveness, status_plan

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
    After ``close()`` every use raises ClientClosed.
    """

    def __init__(self, redis_url: Optional[str] = None, queue: str = "default",
                 namespace: str = "tokenrelay", *, redis_client: Optional[redis.Redis] = None,
                 limits: Limits = DEFAULT_LIMITS, **settings: Any) -> None:
        super().__init__(redis_url, queue, namespace, redis_client, limits, settings, redis)

    # -- lifecycle
    def close(self) -> None:
        """Close the connections. Any later use raises ClientClosed; closing twice is fine."""
        if not self._closed:
            self._closed = True
            self._redis.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def ping(self) -> None:
        """Raise RedisUnavailable unless Redis answers."""
        self._call(self.redis.ping)

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except NET_ERRORS as exc:
            raise RedisUnavailable(self.url, exc) from exc

    # -- submit
    def submit(self, prompt: Optional[str] = None, *, messages: Optional[list[dict]] = None,
               prompt_token_ids: Optional[list[int]] = None, job_id: Optional[str] = None,
               priority: int = 0, deadline_s: Optional[float] = None, stream: bool = True,
               metadata: Optional[dict[str, Any]] = None, block: bool = False,
               block_timeout: Optional[float] = None,
               chat_template_kwargs: Optional[dict[str, Any]] = None,
               traceparent: Optional[str] = None, routing_key: Optional[str] = None,
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
        """
        prepared = self._builder.build(prompt, messages, prompt_token_ids, job_id=job_id,
                                       priority=priority, deadline_s=deadline_s, stream=stream,
                                       metadata=metadata,
                                       chat_template_kwargs=chat_template_kwargs,
                                       traceparent=traceparent, routing_key=routing_key,
                                       **sampling)
        return self.enqueue([prepared], block=block, block_timeout=block_timeout)[0]

    def submit_many(self, requests: Iterable[Any], *, block: bool = True,
                    block_timeout: Optional[float] = None, **defaults: Any) -> list[Job]:
        """Enqueue many jobs in pipelined script calls; returns Jobs in input order.

        Each request is a prompt string or a dict of submit() keyword arguments; ``defaults``
        (sampling fields, priority, stream, ...) apply to every request that does not override
        them. Everything is validated before the first job is sent. Bulk default: ``block=True``
        waits for room; with ``block=False`` QueueFull carries the jobs that did go in.
        """
        prepared = self._builder.build_many(requests, defaults, now_ms())
        return self.enqueue(prepared, block=block, block_timeout=block_timeout)

    def prepare(self, request: Any, **defaults: Any) -> Prepared:
        """Validate and encode one request without sending it (for custom windows)."""
        return self._builder.build_request(request, defaults)

    def enqueue(self, prepared: Sequence[Prepared], *, block: bool,
                block_timeout: Optional[float] = None) -> list[Job]:
        """Send prepared jobs; the core of submit/submit_many."""
        if not prepared:
            return []
        if not self._script_loaded:
            # Load once up front: a NOSCRIPT reply would make the first round travel twice.
            self._call(self.redis.script_load, ENQUEUE_LUA)
            self._script_loaded = True
        self._call(self._affinity.route, self.redis, prepared)
        plan = EnqueuePlan(prepared, self._scripts, self.config.chunk_size)
        deadline = Deadline(block_timeout)
        pause = 0.02
        while True:
            cmds = plan.round()
            if cmds:
                self._run_round(plan, cmds)
                continue
            if not plan.refused:
                break
            if not block or deadline.expired:
                raise self._queue_full(plan)
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
            plan.requeue_refused()
        return [Job(self, p.job_id, reattached=e[0]) for p, e in zip(prepared, plan.entries)]

    def _queue_full(self, plan: EnqueuePlan) -> QueueFull:
        accepted = [Job(self, plan.jobs[i].job_id, reattached=plan.entries[i][0])
                    for i in plan.accepted()]
        return QueueFull(plan.refused_queue(self.keys.queue), plan.depth, plan.limit,
                         reason="oom" if plan.oom else "high-water mark", accepted=accepted)

    def _run_round(self, plan: EnqueuePlan, cmds: list[tuple[list[int], bytes]]) -> None:
        replies = self._send_pipelined([c for _, c in cmds])
        load = False
        for (idx, _), rep in zip(cmds, replies):
            if isinstance(rep, NoScriptError):
                plan.resend(idx)
                load = True
            elif is_oom(rep):
                plan.refuse_oom(idx)
            elif isinstance(rep, Exception):
                raise rep
            else:
                plan.on_reply(idx, rep)
        if load:
            self._call(self.redis.script_load, ENQUEUE_LUA)

    def _send_pipelined(self, commands: list[bytes]) -> list[Any]:
        """Send packed commands on one connection, keeping pipeline_depth replies outstanding.

        A dropped connection retries the whole round once: the script is idempotent per job id.
        """
        for attempt in (1, 2):
            try:
                return self._send_once(commands)
            except NET_ERRORS as exc:
                if attempt == 2:
                    raise RedisUnavailable(self.url, exc) from exc
                time.sleep(0.1)
        raise AssertionError("unreachable")

    def _send_once(self, commands: list[bytes]) -> list[Any]:
        pool = self.redis.connection_pool
        conn = pool.get_connection()
        try:
            replies: list[Any] = []
            depth = self.config.pipeline_depth
            for i, data in enumerate(commands):
                conn.send_packed_command([data], check_health=(i == 0))
                if i + 1 - len(replies) >= depth:
                    replies.append(_read_reply(conn))
            while len(replies) < len(commands):
                replies.append(_read_reply(conn))
            return replies
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    # -- jobs
    def get(self, job_id: str) -> Job:
        """Reattach to a job by id (e.g. from another process). Raises JobNotFound."""
        validate_job_id(job_id)
        job = Job(self, job_id, reattached=True)
        if self.probe([job])[0] == "unknown":
            raise JobNotFound(job_id)
        return job

    def probe(self, jobs: Sequence[Job]) -> list[str]:
        """Per job: 'active' (queued, running or has results), 'lost' or 'unknown' (see
        ``status.liveness``); marks lost jobs so reading them fails at once."""
        found = [liveness(s) for s in self._statuses([j.id for j in jobs], position=False)]
        for j, state in zip(jobs, found):
            if state == "lost":
                j.state.mark_lost()
        return found

    def status(self, job_id: str) -> JobStatus:
        """Where a job stands: queued (lane, approximate position), running (worker, tokens so
        far), done, cancelled, failed, expired or unknown (producer_sdk/status.py). Reads only:
        two round trips, four for a queued job."""
        return self.statuses([job_id])[0]

    def statuses(self, job_ids: Sequence[str]) -> list[JobStatus]:
        """``status`` of many jobs in the round trips of one (e.g. every line of a batch)."""
        for job_id in job_ids:
            validate_job_id(job_id)
        return self._statuses(job_ids)

    def _statuses(self, job_ids: Sequence[str], position: bool = True) -> list[JobStatus]:
        lock = Lockstep([status_plan(self.keys, j, position) for j in job_ids])
        while (steps := lock.round()) is not None:
            lock.feed([self._call(s.pipeline(self.redis).execute, False) for s in steps])
        return lock.results

    def cancel(self, job_id: str) -> None:
        """Set the job's cancel flag (with a TTL); idempotent, works for unknown ids too."""
        self._call(self.redis.set, self.keys.cancel(job_id), b"1", ex=self.config.cancel_ttl_s)

    def queue_depth(self) -> int:
        """Jobs queued or in flight across the lanes (acknowledged entries are deleted)."""
        pipe = self.redis.pipeline(transaction=False)
        for lane in self.keys.lanes():
            pipe.xlen(lane)
        return sum(self._call(pipe.execute))

    def set_max_queued_jobs(self, limit: int) -> None:
        """Set the queue's shared high-water mark (for every producer without its own)."""
        self._call(self.redis.hset, self.keys.config, "max_queued_jobs", int(limit))

    # -- reading results
    def _xread(self, streams: dict[str, bytes], block_ms: int) -> list:
        """XREAD BLOCK that survives dropped connections for up to reconnect_timeout_s."""
        give_up = time.monotonic() + self.config.reconnect_timeout_s
        pause = 0.05
        while True:
            try:
                if len(streams) == 1:
                    return normalize_xread(
                        self.redis.xread(streams, count=XREAD_COUNT, block=block_ms))
                pipe = self.redis.pipeline(transaction=False)
                pipe.xread(streams, count=XREAD_COUNT, block=block_ms)
                pipe.xread(streams, count=XREAD_COUNT)
                return merge_xreads(*pipe.execute())
            except NET_ERRORS as exc:
                if time.monotonic() >= give_up:
                    raise RedisUnavailable(self.url, exc) from exc
                time.sleep(pause)
                pause = min(pause * 2, 1.0)

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
                       ) -> Iterator[tuple[Any, Job]]:
        """Run (tag, prepared job) pairs with at most ``concurrency`` in flight; yield finished
        (tag, Job) pairs as they complete. ``source`` is pulled lazily (bounded memory).

        Already-known job ids reattach instead of resubmitting; those whose results expired come
        back finished with a 'lost' JobFailed. With ``cancel_on_exit`` the jobs still in flight
        are cancelled when the consumer stops early or raises.
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
                    yield from self._start(batch, inflight, block, on_submitted)
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
                self._cancel_many([j.id for _, j in inflight.values()])

    def _start(self, batch: list[tuple[Any, Prepared]], inflight: dict[str, tuple[Any, Job]],
               block: bool, on_submitted: Optional[Callable]) -> Iterator[tuple[Any, Job]]:
        if not batch:
            return
        jobs = self.enqueue([p for _, p in batch], block=block)
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

    def _cancel_many(self, job_ids: list[str]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for jid in job_ids:
            pipe.set(self.keys.cancel(jid), b"1", ex=self.config.cancel_ttl_s)
        try:
            pipe.execute()
        except NET_ERRORS:
            pass  # best effort while unwinding; the original exception matters more

    def map(self, prompts_or_requests: Iterable[Any], *, concurrency: int = 32,
            progress: bool = True, return_exceptions: bool = False, priority: int = 0,
            block: bool = True, **sampling: Any) -> list[Any]:
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
            for i, job in self.iter_completed(source(), concurrency=concurrency, block=block):
                results[i] = _outcome(job.state, return_exceptions)
                bar.update(1)
        finally:
            bar.close()
        return results


def _read_reply(conn: Any) -> Any:
    try:
        return conn.read_response()
    except redis.exceptions.ResponseError as exc:
        return exc


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
