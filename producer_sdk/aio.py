"""The asyncio producer client: the same surface as ``Client``, with await / async for.

Meant for async web backends (FastAPI, aiohttp): nothing here blocks the event loop, and one
AsyncClient is shared by all requests of a process. Payload building, the enqueue script and the
result-stream state machine are the sync client's (``payloads``, ``_wire``, ``job.JobState``);
only the waiting differs.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Callable, Iterable, Optional, Sequence

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from producer_sdk._wire import (EnqueuePlan, QueueState, is_oom, is_transient,
                                merge_reads, merge_xreads, normalize_xread, parse_raw_xread,
                                sliced_xread, slot_groups)
from producer_sdk.client import (XREAD_COUNT, _len_or_none, _outcome, map_defaults,
                                 progress_bar, take_batch)
from producer_sdk.client_core import (LIMIT_FIELD, NET_ERRORS, SEND_ERRORS, ClientCore, Retrying,
                                     make_async_redis)
from producer_sdk.errors import DUPLICATE, JobNotFound, RedisUnavailable
from producer_sdk.job import (Deadline, Delta, JobHandle, JobState, Result, StreamCursor,
                              feed_states, timeout_error)
from producer_sdk.payloads import Prepared
from protocol.keys import Keys
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.scripts import ENQUEUE
from protocol.wire import now_ms, validate_job_id
from producer_sdk.status import JobStatus, Lockstep, liveness, status_plan
from protocol.topology import (Packed, async_send_packed, async_send_packed_trailed,
                               detect_cluster, is_cluster, node_name)


class AsyncJob(JobHandle):
    """A handle on one submitted job (asyncio)."""

    __slots__ = ()

    async def stream(self, timeout: Optional[float] = None) -> AsyncIterator[Delta]:
        """Yield deltas as they arrive; raises JobFailed on error, TimeoutError on timeout.
        Several tasks may stream one job: each sees every delta from its start once."""
        cursor = StreamCursor(self, timeout)
        try:
            while (deltas := cursor.take()) is not None:
                for delta in deltas:
                    yield delta
                if not deltas:
                    await self.client._pump_one(self.state, cursor.deadline)
        finally:
            cursor.close()
        self._raise_if_failed()

    async def result(self, timeout: Optional[float] = None) -> Result:
        """Reads Redis at least once, so ``timeout=0`` returns a finished job's result."""
        deadline = Deadline(timeout)
        while not self.state.finished:
            await self.client._pump_one(self.state, deadline)
            if not self.state.finished and self._timed_out(deadline):
                raise timeout_error(self.id, timeout, streaming=False)
        return self.state.result()

    async def cancel(self) -> None:
        await self.client._cancel_keys([self.cancel_key])


class AsyncClient(ClientCore[aioredis.Redis]):
    """Asyncio producer client for one queue; see ``Client`` for the semantics of each method
    (``limits``, cluster and shards, durable submits, ClientClosed after ``close()``). The
    Redis client is made on first use; asking a server whether it is a cluster node runs in a
    thread, so it never blocks the event loop."""

    def __init__(self, redis_url: Optional[str] = None, queue: str = "default",
                 namespace: str = "tokenrelay", *, redis_client: Optional[Any] = None,
                 limits: Limits = DEFAULT_LIMITS, **settings: Any) -> None:
        super().__init__(redis_url, queue, namespace, redis_client, limits, settings)

    def _make_redis(self) -> Any:
        return make_async_redis(self.config)

    async def _conn(self) -> Any:
        """The Redis client, made now if needed (cluster detection in a thread)."""
        if self._redis is None and not self._closed:
            cluster = self.config.cluster
            if cluster is None:
                try:
                    cluster = await asyncio.to_thread(detect_cluster, self.config.redis_url,
                                                      self.config.connect_timeout_s)
                except NET_ERRORS as exc:
                    raise RedisUnavailable(self.url, exc) from exc
            if self._redis is None:
                self._redis = make_async_redis(self.config, cluster)
        return self.redis

    async def close(self) -> None:
        """Close the connections. Any later use raises ClientClosed; closing twice is fine."""
        if not self._closed:
            self._closed = True
            if self._redis is not None:
                await self._redis.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except NET_ERRORS as exc:
            raise RedisUnavailable(self.url, exc) from exc

    async def ping(self) -> None:
        await self._call((await self._conn()).ping)

    # -- queues
    async def _queue(self, queue: Optional[str] = None, fresh: bool = False) -> QueueState:
        st = self._cached_queue(queue, fresh)
        if st is None:
            key, *fields = self._config_read(queue)
            r = await self._conn()
            st = self._store_queue(queue, *await self._call(r.hmget, key, fields))
        return st

    async def keys_of(self, queue: Optional[str] = None) -> Keys:
        """The keys of ``queue`` (None: the client's), with its shard count (see Client)."""
        return (await self._queue(queue)).keys

    @property
    def keys(self) -> Keys:
        """The keys of the client's queue, once known (after the first call that used Redis,
        or ``await client.keys_of()``)."""
        st = self._cached_queue(None, False)
        if st is None:
            raise RuntimeError("the queue's shard count is read on first use: "
                               "await client.keys_of() first")
        return st.keys

    # -- submit
    async def submit(self, prompt: Optional[str] = None, *, messages: Optional[list[dict]] = None,
                     prompt_token_ids: Optional[list[int]] = None, job_id: Optional[str] = None,
                     priority: int = 0, deadline_s: Optional[float] = None, stream: bool = True,
                     metadata: Optional[dict[str, Any]] = None, block: bool = False,
                     block_timeout: Optional[float] = None,
                     chat_template_kwargs: Optional[dict[str, Any]] = None,
                     traceparent: Optional[str] = None, routing_key: Optional[str] = None,
                     durable: Optional[bool] = None,
                     **sampling: Any) -> AsyncJob:
        prepared = self._builder.build(prompt, messages, prompt_token_ids, job_id=job_id,
                                       priority=priority, deadline_s=deadline_s, stream=stream,
                                       metadata=metadata,
                                       chat_template_kwargs=chat_template_kwargs,
                                       traceparent=traceparent, routing_key=routing_key,
                                       **sampling)
        return (await self.enqueue([prepared], block=block, block_timeout=block_timeout,
                                   durable=durable))[0]

    async def submit_many(self, requests: Iterable[Any], *, block: bool = True,
                          block_timeout: Optional[float] = None, durable: Optional[bool] = None,
                          **defaults: Any) -> list[AsyncJob]:
        prepared = self._builder.build_many(requests, defaults, now_ms())
        return await self.enqueue(prepared, block=block, block_timeout=block_timeout,
                                  durable=durable)

    def prepare(self, request: Any, **defaults: Any) -> Prepared:
        return self._builder.build_request(request, defaults)

    async def enqueue(self, prepared: Sequence[Prepared], *, block: bool,
                      block_timeout: Optional[float] = None,
                      durable: Optional[bool] = None) -> list[AsyncJob]:
        if not prepared:
            return []
        r = await self._conn()
        if not self._script_loaded:
            await self._call(r.script_load, ENQUEUE.source)
            self._script_loaded = True
        await self._affinity.aroute(r, prepared)
        plan = self._plan(list(prepared), durable)
        deadline = Deadline(block_timeout)
        retry = self._retrying()
        pause = 0.02
        while True:
            if plan.todo:
                failed = await self._run_round(plan, retry)
                if failed is not None:
                    wait = retry.pause()
                    if wait is None:
                        raise RedisUnavailable(self.url, failed)
                    await asyncio.sleep(wait)
                continue
            if not plan.refused:
                break
            if not block or deadline.expired:
                raise self._queue_full(AsyncJob, plan)
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.5)
            plan.requeue_refused()
        return self._finish(AsyncJob, plan)

    async def _run_round(self, plan: EnqueuePlan, retry: Retrying) -> Optional[Exception]:
        states = {q: await self._queue(q, fresh=True) for q in plan.queues()}
        plan.place(states)
        reads = plan.depth_reads(states)
        depths = (await self._send(reads, retry))[0] if reads else []
        cmds = plan.round(states, depths)
        replies, acks = await self._send([c for _, c in cmds], retry, self._wait_command(plan))
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
            await self._call(self.redis.script_load, ENQUEUE.source)
        return failed

    async def _send(self, items: list[Packed], retry: Retrying, trailer: Optional[bytes] = None,
                    ) -> tuple[list[Any], list[Any]]:
        while True:
            try:
                return await async_send_packed_trailed(self.redis, items, trailer)
            except SEND_ERRORS as exc:
                wait = retry.pause()
                if wait is None:
                    raise RedisUnavailable(self.url, exc) from exc
                await asyncio.sleep(wait)

    # -- jobs
    async def get(self, job_id: str, queue: Optional[str] = None) -> AsyncJob:
        validate_job_id(job_id)
        job = AsyncJob(self, job_id, keys=await self.keys_of(queue), reattached=True)
        if (await self.probe([job]))[0] == "unknown":
            raise JobNotFound(job_id)
        return job

    async def probe(self, jobs: Sequence[AsyncJob]) -> list[str]:
        found = [liveness(s) for s in await self._statuses(
            [(j.keys, j.id, j.shard) for j in jobs], position=False)]
        for j, state in zip(jobs, found):
            if state == "lost":
                j.state.mark_lost()
        return found

    async def status(self, job_id: str, queue: Optional[str] = None) -> JobStatus:
        return (await self.statuses([job_id], queue))[0]

    async def statuses(self, job_ids: Sequence[str],
                       queue: Optional[str] = None) -> list[JobStatus]:
        for job_id in job_ids:
            validate_job_id(job_id)
        keys = await self.keys_of(queue)
        return await self._statuses([(keys, j, None) for j in job_ids])

    async def _statuses(self, targets: Sequence[tuple[Keys, str, Optional[int]]],
                        position: bool = True) -> list[JobStatus]:
        r = await self._conn()
        lock = Lockstep([status_plan(k, j, s, position) for k, j, s in targets],
                        by_slot=is_cluster(r))
        while (steps := lock.round()) is not None:
            lock.feed([await self._call(s.pipeline(r).execute, False) for s in steps])
        return lock.results

    async def cancel(self, job_id: str, queue: Optional[str] = None) -> None:
        await self._cancel_keys([(await self.keys_of(queue)).cancel(job_id)])

    async def _cancel_keys(self, keys: list[str]) -> None:
        r = await self._conn()
        if len(keys) == 1:
            await self._call(r.set, keys[0], b"1", ex=self.config.cancel_ttl_s)
            return
        pipe = r.pipeline(transaction=False)
        for key in keys:
            pipe.set(key, b"1", ex=self.config.cancel_ttl_s)
        await self._call(pipe.execute)

    async def queue_depth(self, queue: Optional[str] = None) -> int:
        keys = await self.keys_of(queue)
        pipe = self.redis.pipeline(transaction=False)
        for lane in keys.lanes():
            pipe.xlen(lane)
        return sum(await self._call(pipe.execute))

    async def set_max_queued_jobs(self, limit: int, queue: Optional[str] = None) -> None:
        r = await self._conn()
        await self._call(r.hset, self._config_key(queue), LIMIT_FIELD, int(limit))
        self._stale(queue)

    # -- reading results
    async def _xread(self, streams: dict[str, bytes], block_ms: int) -> list:
        give_up = time.monotonic() + self.config.reconnect_timeout_s
        pause = 0.05
        while True:
            try:
                return await self._xread_once(streams, block_ms)
            except NET_ERRORS as exc:
                if time.monotonic() >= give_up:
                    raise RedisUnavailable(self.url, exc) from exc
                await asyncio.sleep(pause)
                pause = min(pause * 2, 1.0)

    async def _xread_once(self, streams: dict[str, bytes], block_ms: int) -> list:
        r = await self._conn()
        if len(streams) == 1:
            return normalize_xread(await r.xread(streams, count=XREAD_COUNT, block=block_ms))
        if not is_cluster(r) or len(slot_groups(streams)) == 1:
            pipe = r.pipeline(transaction=False)
            pipe.xread(streams, count=XREAD_COUNT, block=block_ms)
            pipe.xread(streams, count=XREAD_COUNT)
            return merge_xreads(*await pipe.execute())
        await r.initialize()
        end = time.monotonic() + block_ms / 1000
        while True:
            items = sliced_xread(streams, lambda k: node_name(r, k), XREAD_COUNT, block_ms)
            got = merge_reads(parse_raw_xread(x) for x in await async_send_packed(r, items))
            left_ms = int((end - time.monotonic()) * 1000)
            if got or left_ms <= 0:
                return got
            block_ms = left_ms

    async def _pump(self, states: Iterable[JobState],
                    block_ms: int) -> list[tuple[JobState, list[Delta]]]:
        by_key = {s.key: s for s in states if not s.finished}
        if not by_key:
            return []
        return feed_states(by_key, await self._xread({k: s.last_id for k, s in by_key.items()},
                                                     block_ms), XREAD_COUNT)

    async def _pump_one(self, state: JobState, deadline: Deadline) -> list[Delta]:
        got = await self._pump([state], deadline.block_ms(self.config.poll_ms))
        return got[0][1] if got else []

    async def iter_completed(self, source: Iterable[tuple[Any, Prepared]], *,
                             concurrency: int = 64, block: bool = True,
                             cancel_on_exit: bool = True, durable: Optional[bool] = None,
                             ) -> AsyncIterator[tuple[Any, AsyncJob]]:
        """Async twin of ``Client.iter_completed`` (source is a plain iterable)."""
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        it = iter(source)
        inflight: dict[str, tuple[Any, AsyncJob]] = {}
        exhausted = False
        try:
            while True:
                if not exhausted and len(inflight) < concurrency:
                    batch, exhausted = take_batch(it, concurrency - len(inflight))
                    for pair in await self._start(batch, inflight, block, durable):
                        yield pair
                if not inflight:
                    if exhausted:
                        return
                    continue
                for state, _ in await self._pump([j.state for _, j in inflight.values()],
                                                 self.config.poll_ms):
                    if state.finished:
                        yield inflight.pop(state.key)
        finally:
            if cancel_on_exit and inflight:
                await self._cancel_many([j for _, j in inflight.values()])

    async def _start(self, batch: list[tuple[Any, Prepared]],
                     inflight: dict[str, tuple[Any, AsyncJob]], block: bool,
                     durable: Optional[bool] = None) -> list[tuple[Any, AsyncJob]]:
        if not batch:
            return []
        jobs = await self.enqueue([p for _, p in batch], block=block, durable=durable)
        pairs = [(tag, job) for (tag, _), job in zip(batch, jobs)]
        reattached = [j for _, j in pairs if j.reattached]
        if reattached:
            await self.probe(reattached)
        finished = []
        for tag, job in pairs:
            if job.state.finished:
                finished.append((tag, job))
            elif job.state.key in inflight:
                job.state.fail(DUPLICATE, f"job id {job.id} is already in flight in "
                               f"this window (duplicate request id)")
                finished.append((tag, job))
            else:
                inflight[job.state.key] = (tag, job)
        return finished

    async def _cancel_many(self, jobs: list[AsyncJob]) -> None:
        try:
            await self._cancel_keys([j.cancel_key for j in jobs])
        except RedisUnavailable:
            pass  # best effort while unwinding

    async def map(self, prompts_or_requests: Iterable[Any], *, concurrency: int = 32,
                  progress: bool = True, return_exceptions: bool = False, priority: int = 0,
                  block: bool = True, durable: Optional[bool] = None,
                  **sampling: Any) -> list[Any]:
        """Results in input order with at most ``concurrency`` jobs in flight."""
        defaults = map_defaults(sampling, {"priority": priority})
        results: list[Any] = []
        bar = progress_bar(_len_or_none(prompts_or_requests), progress, "map")

        def source() -> Iterable[tuple[int, Prepared]]:
            for i, req in enumerate(prompts_or_requests):
                results.append(None)
                yield i, self._builder.build_request(req, defaults)

        try:
            async for i, job in self.iter_completed(source(), concurrency=concurrency,
                                                    block=block, durable=durable):
                results[i] = _outcome(job.state, return_exceptions)
                bar.update(1)
        finally:
            bar.close()
        return results


__all__ = ["AsyncClient", "AsyncJob"]
