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
from redis.exceptions import NoScriptError, ResponseError

from producer_sdk._wire import ENQUEUE_LUA, EnqueuePlan, is_oom, merge_xreads, normalize_xread
from producer_sdk.client import (XREAD_COUNT, _len_or_none, _outcome, map_defaults,
                                 progress_bar, take_batch)
from producer_sdk.client_core import NET_ERRORS, ClientCore
from producer_sdk.errors import DUPLICATE, JobNotFound, QueueFull, RedisUnavailable
from producer_sdk.job import (Deadline, Delta, JobHandle, JobState, Result, StreamCursor,
                              feed_states, timeout_error)
from producer_sdk.payloads import Prepared
from producer_sdk.protocol import DEFAULT_LIMITS, Limits, now_ms, validate_job_id
from producer_sdk.status import JobStatus, Lockstep, liveness, status_plan


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
        await self.client.cancel(self.id)


class AsyncClient(ClientCore[aioredis.Redis]):
    """Asyncio producer client for one queue; see ``Client`` for the semantics of each method
    (``limits``, ClientClosed after ``close()``)."""

    def __init__(self, redis_url: Optional[str] = None, queue: str = "default",
                 namespace: str = "tokenrelay", *, redis_client: Optional[aioredis.Redis] = None,
                 limits: Limits = DEFAULT_LIMITS, **settings: Any) -> None:
        super().__init__(redis_url, queue, namespace, redis_client, limits, settings, aioredis)

    async def close(self) -> None:
        """Close the connections. Any later use raises ClientClosed; closing twice is fine."""
        if not self._closed:
            self._closed = True
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
        await self._call(self.redis.ping)

    # -- submit
    async def submit(self, prompt: Optional[str] = None, *, messages: Optional[list[dict]] = None,
                     prompt_token_ids: Optional[list[int]] = None, job_id: Optional[str] = None,
                     priority: int = 0, deadline_s: Optional[float] = None, stream: bool = True,
                     metadata: Optional[dict[str, Any]] = None, block: bool = False,
                     block_timeout: Optional[float] = None,
                     chat_template_kwargs: Optional[dict[str, Any]] = None,
                     traceparent: Optional[str] = None, routing_key: Optional[str] = None,
                     **sampling: Any) -> AsyncJob:
        prepared = self._builder.build(prompt, messages, prompt_token_ids, job_id=job_id,
                                       priority=priority, deadline_s=deadline_s, stream=stream,
                                       metadata=metadata,
                                       chat_template_kwargs=chat_template_kwargs,
                                       traceparent=traceparent, routing_key=routing_key,
                                       **sampling)
        return (await self.enqueue([prepared], block=block, block_timeout=block_timeout))[0]

    async def submit_many(self, requests: Iterable[Any], *, block: bool = True,
                          block_timeout: Optional[float] = None, **defaults: Any) -> list[AsyncJob]:
        prepared = self._builder.build_many(requests, defaults, now_ms())
        return await self.enqueue(prepared, block=block, block_timeout=block_timeout)

    def prepare(self, request: Any, **defaults: Any) -> Prepared:
        return self._builder.build_request(request, defaults)

    async def enqueue(self, prepared: Sequence[Prepared], *, block: bool,
                      block_timeout: Optional[float] = None) -> list[AsyncJob]:
        if not prepared:
            return []
        if not self._script_loaded:
            await self._call(self.redis.script_load, ENQUEUE_LUA)
            self._script_loaded = True
        await self._call(self._affinity.aroute, self.redis, prepared)
        plan = EnqueuePlan(prepared, self._scripts, self.config.chunk_size)
        deadline = Deadline(block_timeout)
        pause = 0.02
        while True:
            cmds = plan.round()
            if cmds:
                await self._run_round(plan, cmds)
                continue
            if not plan.refused:
                break
            if not block or deadline.expired:
                accepted = [AsyncJob(self, plan.jobs[i].job_id, reattached=plan.entries[i][0])
                            for i in plan.accepted()]
                raise QueueFull(plan.refused_queue(self.keys.queue), plan.depth, plan.limit,
                                reason="oom" if plan.oom else "high-water mark", accepted=accepted)
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.5)
            plan.requeue_refused()
        return [AsyncJob(self, p.job_id, reattached=e[0]) for p, e in zip(prepared, plan.entries)]

    async def _run_round(self, plan: EnqueuePlan, cmds: list[tuple[list[int], bytes]]) -> None:
        replies = await self._send_pipelined([c for _, c in cmds])
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
            await self._call(self.redis.script_load, ENQUEUE_LUA)

    async def _send_pipelined(self, commands: list[bytes]) -> list[Any]:
        for attempt in (1, 2):
            try:
                return await self._send_once(commands)
            except NET_ERRORS as exc:
                if attempt == 2:
                    raise RedisUnavailable(self.url, exc) from exc
                await asyncio.sleep(0.1)
        raise AssertionError("unreachable")

    async def _send_once(self, commands: list[bytes]) -> list[Any]:
        pool = self.redis.connection_pool
        conn = await pool.get_connection()
        try:
            replies: list[Any] = []
            depth = self.config.pipeline_depth
            for i, data in enumerate(commands):
                await conn.send_packed_command([data], check_health=(i == 0))
                if i + 1 - len(replies) >= depth:
                    replies.append(await _read_reply(conn))
            while len(replies) < len(commands):
                replies.append(await _read_reply(conn))
            return replies
        except BaseException:
            await conn.disconnect()
            raise
        finally:
            await pool.release(conn)

    # -- jobs
    async def get(self, job_id: str) -> AsyncJob:
        validate_job_id(job_id)
        job = AsyncJob(self, job_id, reattached=True)
        if (await self.probe([job]))[0] == "unknown":
            raise JobNotFound(job_id)
        return job

    async def probe(self, jobs: Sequence[AsyncJob]) -> list[str]:
        found = [liveness(s) for s in await self._statuses([j.id for j in jobs], position=False)]
        for j, state in zip(jobs, found):
            if state == "lost":
                j.state.mark_lost()
        return found

    async def status(self, job_id: str) -> JobStatus:
        return (await self.statuses([job_id]))[0]

    async def statuses(self, job_ids: Sequence[str]) -> list[JobStatus]:
        for job_id in job_ids:
            validate_job_id(job_id)
        return await self._statuses(job_ids)

    async def _statuses(self, job_ids: Sequence[str], position: bool = True) -> list[JobStatus]:
        lock = Lockstep([status_plan(self.keys, j, position) for j in job_ids])
        while (steps := lock.round()) is not None:
            lock.feed([await self._call(s.pipeline(self.redis).execute, False) for s in steps])
        return lock.results

    async def cancel(self, job_id: str) -> None:
        await self._call(self.redis.set, self.keys.cancel(job_id), b"1",
                         ex=self.config.cancel_ttl_s)

    async def queue_depth(self) -> int:
        pipe = self.redis.pipeline(transaction=False)
        for lane in self.keys.lanes():
            pipe.xlen(lane)
        return sum(await self._call(pipe.execute))

    async def set_max_queued_jobs(self, limit: int) -> None:
        await self._call(self.redis.hset, self.keys.config, "max_queued_jobs", int(limit))

    # -- reading results
    async def _xread(self, streams: dict[str, bytes], block_ms: int) -> list:
        give_up = time.monotonic() + self.config.reconnect_timeout_s
        pause = 0.05
        while True:
            try:
                if len(streams) == 1:
                    return normalize_xread(
                        await self.redis.xread(streams, count=XREAD_COUNT, block=block_ms))
                pipe = self.redis.pipeline(transaction=False)
                pipe.xread(streams, count=XREAD_COUNT, block=block_ms)
                pipe.xread(streams, count=XREAD_COUNT)
                return merge_xreads(*await pipe.execute())
            except NET_ERRORS as exc:
                if time.monotonic() >= give_up:
                    raise RedisUnavailable(self.url, exc) from exc
                await asyncio.sleep(pause)
                pause = min(pause * 2, 1.0)

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
                             cancel_on_exit: bool = True) -> AsyncIterator[tuple[Any, AsyncJob]]:
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
                    for pair in await self._start(batch, inflight, block):
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
                await self._cancel_many([j.id for _, j in inflight.values()])

    async def _start(self, batch: list[tuple[Any, Prepared]],
                     inflight: dict[str, tuple[Any, AsyncJob]],
                     block: bool) -> list[tuple[Any, AsyncJob]]:
        if not batch:
            return []
        jobs = await self.enqueue([p for _, p in batch], block=block)
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

    async def _cancel_many(self, job_ids: list[str]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for jid in job_ids:
            pipe.set(self.keys.cancel(jid), b"1", ex=self.config.cancel_ttl_s)
        try:
            await pipe.execute()
        except NET_ERRORS:
            pass

    async def map(self, prompts_or_requests: Iterable[Any], *, concurrency: int = 32,
                  progress: bool = True, return_exceptions: bool = False, priority: int = 0,
                  block: bool = True, **sampling: Any) -> list[Any]:
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
                                                    block=block):
                results[i] = _outcome(job.state, return_exceptions)
                bar.update(1)
        finally:
            bar.close()
        return results


async def _read_reply(conn: Any) -> Any:
    try:
        return await conn.read_response()
    except ResponseError as exc:
        return exc


__all__ = ["AsyncClient", "AsyncJob"]
