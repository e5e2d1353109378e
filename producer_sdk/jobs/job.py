"""Jobs as the producer sees them: deltas while streaming, one Result at the end.

``JobState`` wraps the protocol's ``ResultFold`` (the one reading of a result stream, shared with
the worker's resume-read) with what a reader needs on top: the last entry id seen, so any reader
(sync, async, one job or a thousand multiplexed on one XREAD) resumes from exactly there after a
dropped connection, and a lock plus a log of deltas, so one Job read from two threads at once
(``stream()`` in one, ``result()`` in another) gives each reader every delta exactly once.
"""

from __future__ import annotations

import threading
import time
from typing import Any, AsyncIterator, Iterator, Optional, Union

from tokenrelay.producer_sdk.core.effects import Plan
from tokenrelay.producer_sdk.errors import JOB_LOST, LOST, JobFailed
from tokenrelay.producer_sdk.jobs.signatures import docs_from
from tokenrelay.protocol.fold import Delta, ResultFold
from tokenrelay.producer_sdk.jobs.results import CompletionOutput, Result, job_outputs
from tokenrelay.protocol.events import DoneEvent, ErrorEvent
from tokenrelay.protocol.keys import EVENT_FIELD, Keys
from tokenrelay.protocol.scripts.cancel import CancelTarget, cancel_target

__all__ = ["CompletionOutput", "Result", "job_outputs", "JobState", "JobHandle", "Job",
           "AsyncJob", "Deadline", "StreamCursor", "feed_states", "timeout_error", "Delta"]

_EVENT_KEY = EVENT_FIELD.decode()


def _entry_key(entry_id: bytes) -> tuple[int, int]:
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)


class JobState:
    """Everything read so far from one job's result stream (sans-IO, shared by sync and async).

    ``feed`` is serialized by a lock and ignores entries at or before ``last_id``, so two readers
    whose XREADs overlap fold each entry once, in order. While a ``stream()`` reads, the deltas
    are also kept in a log that each reader walks with its own cursor.

    What a waiting reader decides by itself (``producer_sdk/core/reads.py``) needs a little more: the
    job's dedupe and cancel keys, the request it was submitted with (None for a job reattached
    by id), which lets a reader put a job Redis lost back in its queue, and the job's start
    deadline (epoch ms), past which a job no worker started is the reader's to end.
    """

    __slots__ = ("job_id", "key", "last_id", "fold", "failure", "lock", "delta_count", "log",
                 "log_start", "streamers", "caught_up", "dedupe_key", "cancel_target", "request",
                 "start_deadline_ms", "seen_at", "checked_at", "reruns", "token_seed")

    def __init__(self, job_id: str, key: str, dedupe_key: Optional[str] = None,
                 cancel_target: Optional[CancelTarget] = None, request: Any = None,
                 start_deadline_ms: Optional[int] = None) -> None:
        self.job_id = job_id
        self.key = key
        self.dedupe_key = dedupe_key
        self.cancel_target = cancel_target
        self.request = request                  # producer_sdk.jobs.payloads.Prepared, or None
        self.start_deadline_ms = start_deadline_ms
        self.seen_at = time.monotonic()         # when an entry last arrived (or reading began)
        self.checked_at = 0.0                   # when its records were last checked (reads.py)
        self.reruns = 0                         # times a reader put it back in its queue
        # the seed of the run that made the first delta this reader holds (a later started
        # event may name another: a run whose repeats the fold skipped); what a rerun needs
        self.token_seed: Optional[int] = None
        self.last_id: bytes = b"0-0"
        self.fold = ResultFold(job_id)
        self.failure: Optional[JobFailed] = None  # ended without a terminal event (see fail())
        self.lock = threading.Lock()
        self.delta_count = 0          # deltas folded so far
        self.log: list[Delta] = []    # deltas[log_start:], kept while a stream() reads
        self.log_start = 0
        self.streamers = 0
        self.caught_up = True         # the last read returned everything there was

    @property
    def terminal(self) -> Optional[Union[DoneEvent, ErrorEvent]]:
        return self.fold.terminal

    @property
    def attempts(self) -> int:
        return self.fold.attempts

    @property
    def seed(self) -> Optional[int]:
        return self.fold.seed

    @property
    def finished(self) -> bool:
        return self.fold.terminal is not None or self.failure is not None

    @property
    def started(self) -> bool:
        """A worker took the job: its stream has a ``started`` event (or anything at all)."""
        return self.fold.attempts > 0 or self.delta_count > 0 or self.fold.terminal is not None

    def overdue(self, now_ms: float, grace_ms: float) -> bool:
        """Its start deadline passed ``grace_ms`` ago and no worker has started it."""
        return (self.start_deadline_ms is not None and not self.finished and not self.started
                and now_ms > self.start_deadline_ms + grace_ms)

    def expire(self) -> None:
        """End it the way a worker ends a job read past its deadline (the reader cancels it)."""
        self.fail("expired", "the job did not start before its deadline (deadline_s / "
                  "X-Request-Timeout); it was cancelled, so no worker will run it")

    def lose(self, why: str) -> None:
        """End it with ``job_lost``: Redis no longer holds its records."""
        self.fail(JOB_LOST, why)

    def rerun(self) -> None:
        """Its request went back in the queue under the same id: read the new stream from its
        start (the fold skips the tokens already folded, by ``seq``)."""
        with self.lock:
            self.last_id = b"0-0"
            self.reruns += 1
            self.seen_at = time.monotonic()

    def feed(self, entries: list[tuple[Any, dict]]) -> list[Delta]:
        """Apply result-stream entries in order; return the new deltas (duplicates skipped)."""
        deltas: list[Delta] = []
        with self.lock:
            last = _entry_key(self.last_id)
            if entries:
                self.seen_at = time.monotonic()
            for entry_id, fields in entries:
                eid = entry_id if isinstance(entry_id, bytes) else str(entry_id).encode()
                key = _entry_key(eid)
                if key <= last:
                    continue  # another reader already folded this entry
                self.last_id, last = eid, key
                raw = fields.get(EVENT_FIELD, fields.get(_EVENT_KEY)) if fields else None
                if raw is not None:
                    new = self.fold.apply_raw(raw)
                    if new and self.token_seed is None and self.delta_count + len(deltas) == 0:
                        self.token_seed = self.fold.seed
                    deltas.extend(new)
            self.delta_count += len(deltas)
            if self.streamers:
                self.log.extend(deltas)
            else:
                self.log_start = self.delta_count
        return deltas

    def open_stream(self) -> int:
        """Register a stream() reader; its cursor (deltas before it are not its business)."""
        with self.lock:
            self.streamers += 1
            return self.delta_count

    def read_log(self, cursor: int) -> list[Delta]:
        """Deltas from ``cursor`` on that this reader has not seen yet."""
        with self.lock:
            return self.log[cursor - self.log_start:]

    def close_stream(self) -> None:
        with self.lock:
            self.streamers -= 1
            if not self.streamers:
                self.log = []
                self.log_start = self.delta_count

    def fail(self, code: str, message: str) -> None:
        """End the job on the producer side (e.g. its results expired): result() raises this."""
        if self.fold.terminal is None:
            self.failure = JobFailed(self.job_id, code, message)

    def mark_lost(self) -> None:
        self.fail(LOST, "the job is known but neither queued nor has a result stream: its results "
                  "expired before they were read; resubmit it under a new job id")

    def result(self) -> Result:
        """The final Result; raises JobFailed for error events and lost jobs."""
        t = self.fold.terminal
        if t is None and self.failure is not None:
            raise self.failure
        if t is None:
            raise RuntimeError(f"job {self.job_id} has not finished yet")
        if isinstance(t, ErrorEvent):
            raise JobFailed(self.job_id, t.code, t.message)
        outputs = job_outputs(self.fold, t)
        first = outputs[0]
        return Result(job_id=self.job_id, text=first.text, token_ids=first.token_ids,
                      finish_reason=t.finish_reason, usage=t.usage, timings=t.timings,
                      metadata=t.metadata, logprobs=first.logprobs,
                      token_logprobs=first.token_logprobs, stop_reason=t.stop_reason,
                      attempts=self.fold.attempts, outputs=outputs)


def feed_states(by_key: dict[str, JobState], read: list[tuple[str, list]],
                count: int) -> list[tuple[JobState, list[Delta]]]:
    """Feed each job the entries one XREAD (``COUNT count``) brought for it. A job whose read
    came back full is not caught up: its waiters read again before they time out."""
    for state in by_key.values():
        state.caught_up = True
    out = []
    for key, entries in read:
        state = by_key[key]
        state.caught_up = len(entries) < count
        out.append((state, state.feed(entries)))
    return out


class Deadline:
    """A timeout turned into an absolute monotonic deadline (None = wait forever)."""

    __slots__ = ("end",)

    def __init__(self, timeout: Optional[float]) -> None:
        self.end = None if timeout is None else time.monotonic() + max(0.0, timeout)

    def block_ms(self, cap_ms: int) -> int:
        """Milliseconds for the next XREAD BLOCK (at least 1: BLOCK 0 means forever)."""
        if self.end is None:
            return cap_ms
        return max(1, min(cap_ms, int((self.end - time.monotonic()) * 1000)))

    @property
    def expired(self) -> bool:
        return self.end is not None and time.monotonic() >= self.end


_STATE_LOCK = threading.Lock()  # two threads touching a fresh handle must share one JobState


class JobHandle:
    """What the sync and async job handles share: ids, where the job's keys are (its queue and
    the shard of that queue it was put on), the state read so far, and what reading it means
    (plans, ``producer_sdk.core.effects``); ``Job`` and ``AsyncJob`` only run them on their client."""

    __slots__ = ("client", "id", "keys", "shard", "_state", "reattached", "request")

    def __init__(self, client: Any, job_id: str, *, keys: Keys, shard: Optional[int] = None,
                 reattached: bool = False, request: Any = None) -> None:
        self.client = client
        self.id = job_id
        self.keys = keys                # the keys of the job's queue (its shard count included)
        self.shard = keys.shard_of(job_id) if shard is None else shard
        self._state: Optional[JobState] = None  # created on first read: submit_many stays cheap
        self.reattached = reattached
        self.request = request          # the Prepared it was submitted with; None: by id

    @classmethod
    def enqueued(cls, client: Any, job_id: str, keys: Keys, shard: int, reattached: bool,
                 request: Any) -> "JobHandle":
        """A handle on a job just enqueued (``__init__`` without its keyword parsing: a bulk
        submit makes one per job)."""
        h = cls.__new__(cls)
        h.client, h.id, h.keys, h.shard = client, job_id, keys, shard
        h._state, h.reattached, h.request = None, reattached, request
        return h

    @property
    def queue(self) -> str:
        return self.keys.queue

    @property
    def cancel_target(self) -> CancelTarget:
        """What cancelling it names (``protocol.scripts.cancel``): its flag and records."""
        return cancel_target(self.keys, self.id, self.shard)

    @property
    def state(self) -> JobState:
        if self._state is None:
            with _STATE_LOCK:
                if self._state is None:
                    req = self.request
                    self._state = JobState(
                        self.id, self.keys.results(self.id, self.shard),
                        self.keys.dedupe(self.id, self.shard), self.cancel_target, req,
                        None if req is None else getattr(req, "deadline_ms", None))
        return self._state

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, finished={self.state.finished})"

    @property
    def done(self) -> bool:
        """True once a terminal event was read (does not poll Redis)."""
        return self.state.finished

    def _raise_if_failed(self) -> None:
        state = self.state
        if state.failure is not None or isinstance(state.terminal, ErrorEvent):
            state.result()  # raises JobFailed

    def _timed_out(self, deadline: "Deadline") -> bool:
        """True (caller raises) once the deadline passed and the last read found nothing left
        unread: ``timeout=0`` still reads everything a finished job already wrote."""
        return deadline.expired and self.state.caught_up

    def _result(self, timeout: Optional[float]) -> Plan[Result]:
        """Read until the job finished; its Result. Reads Redis at least once, so
        ``timeout=0`` returns a finished job's result."""
        deadline = Deadline(timeout)
        while not self.state.finished:
            yield from self.client._pump_one(self.state, deadline)
            if not self.state.finished and self._timed_out(deadline):
                raise timeout_error(self.id, timeout, streaming=False)
        return self.state.result()

    def _cancel(self) -> Plan[None]:
        yield from self.client._cancel_jobs([self.cancel_target])


class StreamCursor:
    """One ``stream()`` call's place in a job's delta log: the I/O-free part of ``Job.stream``
    and ``AsyncJob.stream``, which differ only in how they run ``pump()`` when ``take`` says
    so. A context manager: leaving it (also early) unregisters the reader."""

    def __init__(self, job: JobHandle, timeout: Optional[float]) -> None:
        self.job = job
        self.timeout = timeout
        self.deadline = Deadline(timeout)
        self.at = job.state.open_stream()
        self.pumped = False
        self.fresh = False      # the last take before a pump returned deltas

    def __enter__(self) -> "StreamCursor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.job.state.close_stream()

    def take(self) -> Optional[list[Delta]]:
        """The deltas readable now; ``[]``: pump once, then take again; None: the stream is
        over. Raises JobFailed when it ended in an error, TimeoutError once the deadline passed
        and a pump left nothing unread."""
        state = self.job.state
        new = state.read_log(self.at)
        self.at += len(new)
        if new:
            self.fresh = True
            return new
        if state.finished and self.at >= state.delta_count:
            self.job._raise_if_failed()
            return None
        if self.pumped and not self.fresh and self.job._timed_out(self.deadline):
            raise timeout_error(self.job.id, self.timeout, streaming=True)
        self.pumped, self.fresh = True, False
        return []

    def pump(self) -> Plan[list[Delta]]:
        """One read of the job's stream (what ``take`` returns next)."""
        return self.job.client._pump_one(self.job.state, self.deadline)


def timeout_error(job_id: str, timeout: Optional[float], streaming: bool) -> TimeoutError:
    if streaming:
        return TimeoutError(f"job {job_id}: no terminal event within {timeout}s")
    return TimeoutError(f"job {job_id}: not finished within {timeout}s "
                        f"(it keeps running; call job.cancel() to stop it)")


class Job(JobHandle):
    """A handle on one submitted job (sync). Cheap: holds ids and what was read so far.

    Safe to read from several threads: each ``stream()`` sees every delta from its start exactly
    once, in order, while ``result()`` waits in another thread.
    """

    __slots__ = ()

    def stream(self, timeout: Optional[float] = None) -> Iterator[Delta]:
        """Yield deltas as they arrive, from when this call starts; JobFailed on error,
        TimeoutError when no terminal event came within ``timeout`` seconds."""
        with StreamCursor(self, timeout) as cursor:
            while (deltas := cursor.take()) is not None:
                yield from deltas
                if not deltas:
                    self.client._run(cursor.pump())

    def result(self, timeout: Optional[float] = None) -> Result:
        """Wait for the job to finish. Raises JobFailed, or TimeoutError after ``timeout`` s.

        Reads Redis at least once, so ``timeout=0`` returns a finished job's result."""
        return self.client._run(self._result(timeout))

    def cancel(self) -> None:
        """Ask the worker to stop (a queued job never starts). The job ends with done/cancelled."""
        self.client._run(self._cancel())


@docs_from(Job)
class AsyncJob(JobHandle):
    """A handle on one submitted job (asyncio); see ``Job``. Several tasks may stream one job:
    each sees every delta from its start once. Waiting holds no connection of its own: the
    client's shared readers (``producer_sdk/core/hub.py``) read the job with the others."""

    __slots__ = ()

    async def stream(self, timeout: Optional[float] = None) -> AsyncIterator[Delta]:
        hub = self.client.hub
        with hub.watching(self) as watch, StreamCursor(self, timeout) as cursor:
            while (deltas := cursor.take()) is not None:
                for delta in deltas:
                    yield delta
                if not deltas:
                    await hub.wait(watch, cursor.deadline.block_ms(self.client.config.poll_ms)
                                   / 1000)

    async def result(self, timeout: Optional[float] = None) -> Result:
        deadline = Deadline(timeout)
        hub = self.client.hub
        with hub.watching(self) as watch:
            while not self.state.finished:
                await hub.wait(watch, deadline.block_ms(self.client.config.poll_ms) / 1000)
                if not self.state.finished and self._timed_out(deadline):
                    raise timeout_error(self.id, timeout, streaming=False)
        return self.state.result()

    async def cancel(self) -> None:
        await self.client._run(self._cancel())
