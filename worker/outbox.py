"""The result outbox: everything the worker owes Redis, shipped in ONE round trip per step (per
node of a Redis Cluster).

One flush carries every held job's fenced event batch (and reads its cancel flag; one script
call per queue shard, whose jobs' keys share a slot), the dead letters of rejected entries, the
acks owed by the previous flush, and whatever the loop rides on it (hand-backs, the next read
of new entries). Acks ride one flush behind the terminal write
they depend on, so an entry is never acknowledged unless its terminal event is known to be
stored. Every write is idempotent (batch ids, XPENDING-checked acks), so after a lost reply the
same batch is sent again. Transient Redis errors (out of memory, ...) keep everything owed for
the next flush and are reported to the loop, which backs off; they never fail a job. What the
loop must act on comes back from ``flush`` as a ``FlushReport``: those errors, and the jobs to
resume from what their streams hold (a failover lost events they had written).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import redis

from tokenrelay.protocol.errors import ErrorCode
from tokenrelay.protocol.scripts import ScriptPipeline
from tokenrelay.worker.connection import ErrorKind, classify, classify_text
from tokenrelay.worker.deadletters import DeadLetterWriter, Rejection, outcome
from tokenrelay.worker.entries import Entry, EntryKey, by_lane
from tokenrelay.worker.fencing import Fence, WriteStatus, parse_step_reply
from tokenrelay.worker.jobs import Job, JobTable
from tokenrelay.worker.logs import RateLimitedLog
from tokenrelay.worker.metrics import WorkerMetrics
from tokenrelay.worker.pending import AckStatus, PendingList
from tokenrelay.worker.connection import RedisClient
from tokenrelay.worker.logs import Log

MAX_WRITE_FAILURES = 3   # non-transient failures of one job's write before it is dead-lettered
STEP_WRITE_CHUNK = 128   # jobs per write_step call: bounds how long one script holds Redis

# A rider queues its commands on the flush's pipeline and returns what to do with the replies.
Rider = Callable[[ScriptPipeline], Optional[Callable[[list], None]]]

# The points of a flush a test may stop the worker at (``Outbox.fault_point``; only
# tests/fault_worker.py sets it): events built and queued but not sent; a terminal event written
# but its entry not acked yet; acks written (and their replies handled).
FAULT_POINTS = ("built", "written", "acked")


def no_fault(point: str) -> None:
    """The production fault point: nothing happens."""


@dataclass
class OwedAck:
    lane_key: str
    entry_id: str
    job_id: Optional[str]
    reason: str


@dataclass
class FlushReport:
    """What one flush leaves for the loop to act on."""

    transient: Optional[str] = None          # a transient error: back off, everything stays owed
    permanent: Optional[Exception] = None    # a configuration error: the worker exits 78
    resume: list[Entry] = field(default_factory=list)   # jobs dropped to resume from their stream


class Outbox:
    """What the worker owes Redis, and the flush that ships it; see the module docstring."""

    def __init__(self, client: RedisClient, jobs: JobTable, pending: PendingList, fence: Fence,
                 dead: DeadLetterWriter, ttl_ms: int, metrics: WorkerMetrics, log: Log,
                 log_limited: RateLimitedLog,
                 fault_point: Callable[[str], None] = no_fault) -> None:
        self.client = client
        self.fault_point = fault_point   # a test seam: called at each of FAULT_POINTS
        self.jobs = jobs
        self.pending = pending
        self.fence = fence
        self.dead = dead
        self.ttl_ms = ttl_ms
        self.metrics = metrics
        self.log = log
        self.log_limited = log_limited
        self.owed_acks: list[OwedAck] = []
        self.rejections: list[Rejection] = []
        self._report = FlushReport()             # of the flush under way

    # ---------------------------------------------------------------- what is owed
    def owe_ack(self, entry: Entry, job_id: Optional[str], reason: str) -> None:
        self.owed_acks.append(OwedAck(entry.lane_key, entry.entry_id, job_id, reason))

    def reject(self, r: Rejection) -> None:
        self.rejections.append(r)

    def held(self) -> list[EntryKey]:
        return ([r.entry.key for r in self.rejections]
                + [(a.lane_key, a.entry_id) for a in self.owed_acks])

    def owes(self) -> bool:
        return bool(self.owed_acks or self.rejections or any(
            j.pending or j.terminal or not j.in_engine for j in self.jobs.values()))

    def clear(self) -> None:
        self.owed_acks.clear()
        self.rejections.clear()

    # ---------------------------------------------------------------- the flush
    def flush(self, riders: list[Rider], read: Optional[Rider]) -> FlushReport:
        """Ship everything owed, plus the riders, in one pipeline; ``read`` (the next read of
        new entries) rides only on a round trip that happens anyway."""
        report = self._report = FlushReport()
        pipe = ScriptPipeline(self.client)
        acks = bool(self.owed_acks)
        handlers = [self._queue_acks(pipe)]
        step_jobs = [j for j in self.jobs.values() if j.pending or j.in_engine]
        terminal = any(j.terminal and j.pending for j in step_jobs)
        by_shard: dict[int, list[Job]] = {}
        for j in step_jobs:   # one script call per shard: its keys must share a slot
            by_shard.setdefault(j.entry.shard, []).append(j)
        handlers += [self._queue_writes(pipe, shard, jobs[k:k + STEP_WRITE_CHUNK])
                     for shard, jobs in by_shard.items()
                     for k in range(0, len(jobs), STEP_WRITE_CHUNK)]
        handlers += [self._queue_rejection(pipe, r) for r in self.rejections]
        handlers += [rider(pipe) for rider in riders]
        if not len(pipe):
            return report
        if read is not None:
            handlers.append(read(pipe))
        if any(j.pending for j in step_jobs):
            self.fault_point("built")
        t0 = time.perf_counter()
        res = pipe.execute()   # lost reply: the retry is checked, it adds only what is missing
        self.metrics.step_redis.observe(time.perf_counter() - t0)
        if terminal:
            self.fault_point("written")
        for handle in handlers:
            if handle is not None:
                handle(res)
        if acks:
            self.fault_point("acked")
        return report

    def _note_error(self, what: str, error: Any, **fields: Any) -> bool:
        """Log (rate-limited) a failed command; True when it was transient."""
        kind = classify(error) if isinstance(error, Exception) else classify_text(str(error))
        if kind is ErrorKind.TRANSIENT:
            self._report.transient = str(error)
        elif kind is ErrorKind.PERMANENT:
            self._report.permanent = (error if isinstance(error, Exception)
                                      else redis.ResponseError(error))
        self.log_limited("warning" if kind is ErrorKind.TRANSIENT else "error",
                         f"{what} failed; will retry", error=str(error), kind=kind.value,
                         **fields)
        return kind is ErrorKind.TRANSIENT

    # ---------------------------------------------------------------- acks
    def _queue_acks(self, pipe: ScriptPipeline) -> Callable[[list], None]:
        owed = list(self.owed_acks)
        groups = by_lane((a.lane_key, a) for a in owed)
        queued = [(items, self.pending.queue_ack(pipe, lane, [a.entry_id for a in items]))
                  for lane, items in groups.items()]

        def handle(res: list) -> None:  # runs first: nothing was owed since ``owed``
            self.owed_acks = []
            for items, i in queued:
                self._on_acks(items, res[i])
        return handle

    def _on_acks(self, items: list[OwedAck], reply: Any) -> None:
        if isinstance(reply, Exception):
            self._note_error("ack", reply)
            self.owed_acks.extend(items)
            return
        for a, code in zip(items, reply):
            job = self.jobs.get(a.job_id) if a.job_id else None
            if job is not None and job.entry.entry_id == a.entry_id:
                self.jobs.pop(a.job_id)
            if AckStatus(int(code)) is AckStatus.NOT_OWNER:
                self.log.warning("not acked: another worker holds the entry", job_id=a.job_id,
                                 entry_id=a.entry_id)
            else:
                self.log.debug("acked", job_id=a.job_id, entry_id=a.entry_id, reason=a.reason,
                               was_pending=AckStatus(int(code)) is AckStatus.ACKED)

    # ---------------------------------------------------------------- event writes
    def _queue_writes(self, pipe: ScriptPipeline, shard: int,
                      chunk: list[Job]) -> Callable[[list], None]:
        """One WRITE_STEP call for ``chunk``; the handler applies its reply. One pass over the
        jobs (this runs for every running job every step: issue #29)."""
        now = time.monotonic()
        due_after = self.ttl_ms / 10_000.0
        writes, releases, counts, refresh, batches = [], [], [], [], []
        for j in chunk:
            # Reset the job's TTLs with a terminal event (the stream then lives result_ttl from
            # its end) or once a tenth of the TTL has passed since the last reset (creation and
            # checked retries always set them).
            r = bool(j.terminal) or now - j.ttl_set_at > due_after
            writes.append((j.job_id, j.owner, j.batch_id, j.pending, j.may_create,
                           j.stream_len, r))
            releases.append(j.entry.cost if j.terminal else 0)
            counts.append(len(j.pending))
            refresh.append(r)
            batches.append(j.batch_no)
        i = self.fence.write_step(pipe, self.ttl_ms, shard, writes, releases)

        def handle(res: list) -> None:
            self._on_step_reply(chunk, counts, res[i])
            for job, r, before in zip(chunk, refresh, batches):
                if r and job.batch_no > before:     # written, so its TTLs were reset
                    job.ttl_set_at = now
        return handle

    def _on_step_reply(self, jobs: list[Job], counts: list[int], reply: Any) -> None:
        if isinstance(reply, Exception):  # the whole call failed: every write is retried
            for job, n in zip(jobs, counts):
                if n:
                    self._on_write(job, n, WriteStatus.ERROR, str(reply))
            return
        for job, n, (status, cancel, detail) in zip(jobs, counts, parse_step_reply(reply)):
            if n:
                self._on_write(job, n, status, detail)
            if cancel and job.in_engine:
                self.jobs.cancel(job, "cancel flag")

    def _on_write(self, job: Job, n: int, status: WriteStatus, detail: str) -> None:
        if status is WriteStatus.ERROR:
            if self._note_error("result write", detail, **job.log_fields()):
                return  # transient: the same batch goes again after backoff, uncounted
            job.write_failures += 1
            if job.write_failures >= MAX_WRITE_FAILURES:
                self.jobs.drop(job, f"result stream not writable: {detail}")
                self.reject(Rejection(job.entry, ErrorCode.INTERNAL.value,
                                      f"the worker could not write the job's result stream: "
                                      f"{detail}", job.job_id, job.request.metadata))
            return
        if status.written:
            job.stream_len += n
            del job.pending[:n]
            job.batch_no += 1
            job.may_create = False
            job.write_failures = 0
            if job.terminal and not job.pending:
                self.owe_ack(job.entry, job.job_id, job.terminal)
        elif status is WriteStatus.BEHIND:
            # A failover or a restart lost our last acknowledged writes: resume the job from
            # what its stream holds now (re-admitted as a takeover would be).
            self.jobs.drop(job, "its result stream lost events (a Redis failover or restart); "
                                "resuming from what the stream holds")
            self._report.resume.append(job.entry)
        elif status is WriteStatus.REFUSED:
            self.jobs.drop(job, "ownership lost: another worker took the job over")
        else:  # missing/gone: expired, or lost in a Redis restart; never recreated
            self.jobs.drop(job, f"result stream {status.value}: Redis no longer holds the job's "
                                "records (expired, or lost with Redis's data); ending it here, "
                                "writing nothing (its readers enqueue it again or end it)")
            self.owe_ack(job.entry, job.job_id, f"result stream {status.value}")

    # ---------------------------------------------------------------- dead letters
    def _queue_rejection(self, pipe: ScriptPipeline, r: Rejection) -> Callable[[list], None]:
        i = self.dead.queue(pipe, r)

        def handle(res: list) -> None:
            if isinstance(res[i], Exception):
                self._note_error("dead letter write", res[i], entry_id=r.entry.entry_id)
                return  # stays in self.rejections: retried with the next flush
            self.rejections.remove(r)
            self.metrics.dead_letters.labels(r.code).inc()
            if outcome(res[i]) == "other":
                self.log.warning("error event not written: the job id belongs to another "
                                   "entry", job_id=r.job_id, entry_id=r.entry.entry_id)
            self.owe_ack(r.entry, r.job_id, "dead-lettered")
        return handle
