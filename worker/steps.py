"""One engine step: deltas into queued events, then (after the flush) the step's logs and
metrics; and what happens to the held jobs when a step raises.

``run`` is the engine step alone and ``build`` turns its deltas into events: in series
(``step``), or, when the loop overlaps, the writer's thread builds step N's events while the
loop's thread runs step N+1 (worker/writer.py). Logs and metrics wait until after the flush
(``account``): they are not on the path from the engine to the reader. A step that raises
hands the jobs back here and returns an ``EngineFailure``; what the worker does about it
(report the engine unloaded, exit 1) is the loop's decision (worker/service.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import redis

from tokenrelay.protocol.errors import ErrorCode
from tokenrelay.worker.deadletters import Rejection
from tokenrelay.worker.engine_api import EngineAPI
from tokenrelay.worker.jobs import Job, JobTable
from tokenrelay.worker.metrics import WorkerMetrics, observe_many
from tokenrelay.worker.outbox import Outbox
from tokenrelay.worker.pending import PendingList
from tokenrelay.worker.logs import Log


@dataclass(frozen=True)
class EngineFailure:
    """An engine step raised ``error``: the engine may be unusable now (a CUDA error poisons
    the context). The jobs it ran were already handed back or parked (``Stepper``)."""

    error: Exception


@dataclass(frozen=True)
class StepOutcome:
    """What one engine step returned (``deltas``, ``ts`` when it returned) or raised, and the
    jobs it ran (``ran``: job id -> the Job object in the engine when it started)."""

    deltas: Sequence[Any]
    ts: float
    ran: dict[str, Job]
    error: Optional[Exception] = None


class Stepper:
    """Runs engine steps and turns their deltas into events on the held jobs."""

    def __init__(self, engine: EngineAPI, jobs: JobTable, outbox: Outbox, pending: PendingList,
                 max_deliveries: int, metrics: WorkerMetrics, log: Log) -> None:
        self.engine = engine
        self.jobs = jobs
        self.outbox = outbox
        self.pending = pending
        self.max_deliveries = max_deliveries
        self.metrics = metrics
        self.log = log
        self._stepped: list[tuple] = []     # (job, delta, prev token time, first, ts, ended)
        self._held: Optional[StepOutcome] = None

    def step(self) -> Optional[EngineFailure]:
        """One engine step, its deltas turned into events at once (the loop in series); None
        when it ran, the failure (jobs already handed back) when it raised."""
        self.run(self.running())
        return self.build(self.detach())

    def running(self) -> dict[str, Job]:
        """The jobs in the engine now, by id: taken before a step (and before the writer's
        flush starts: the flush changes the table)."""
        return {jid: j for jid, j in self.jobs.items() if j.in_engine}

    def run(self, ran: dict[str, Job]) -> None:
        """Only the engine step, timed; its outcome is held until ``build`` (the writer's
        thread builds it while the loop's thread runs the next step). Touches no job."""
        t0 = time.perf_counter()
        try:
            deltas = self.engine.step()
        except Exception as exc:
            self._held = StepOutcome([], 0.0, ran, exc)
            return
        self._held = StepOutcome(deltas, time.time(), ran)
        self.metrics.engine_step.observe(time.perf_counter() - t0)

    def detach(self) -> Optional["StepOutcome"]:
        """The outcome of the last ``run`` not built yet (None: none), now the caller's."""
        out, self._held = self._held, None
        return out

    def owes(self) -> bool:
        """A step's outcome waits to be built into events."""
        return self._held is not None

    def failed(self) -> bool:
        """The held outcome is an engine failure (the loop builds it at once, in its thread)."""
        return self._held is not None and self._held.error is not None

    def build(self, outcome: Optional["StepOutcome"]) -> Optional[EngineFailure]:
        """Turn a step's deltas into events on the jobs that ran it; a failed step hands the
        jobs back. A delta is dropped when its job left the engine since (cancelled, dropped)
        or is no longer the job of that id in the table: a job dropped and admitted again
        (resumed after a failover lost its events) must never take its old run's deltas."""
        if outcome is None:
            return None
        if outcome.error is not None:
            return self._engine_failed(outcome.error)
        ts, table = outcome.ts, self.jobs
        for d in outcome.deltas:
            job = outcome.ran.get(d.request_id)
            if job is None or not job.in_engine or table.get(d.request_id) is not job:
                continue
            if d.error is not None:     # the engine ended this request alone (its grammar)
                job.in_engine = False
                self.jobs.fail(job, _error_code(d.error.code), d.error.message)
                continue
            prev, open_ = job.last_token_at, job.terminal is None
            first = job.on_delta(d, ts)
            ended = open_ and job.terminal is not None   # its last choice finished
            if ended:
                job.in_engine = False
            self._stepped.append((job, d, prev, first, ts, ended))
        return None

    def account(self) -> None:
        """Logs and metrics of the last step (after its flush)."""
        m, log = self.metrics, self.log
        tokens, gaps = 0, {}    # summed per step: one counter and histogram update, not per token
        for job, d, prev, first, ts, ended in self._stepped:
            if first:
                m.ttft.observe(max(0.0, ts - job.enqueued_ms / 1000))
                log.debug("first_token", **job.log_fields())
            n = len(d.new_token_ids)
            if n:
                tokens += n
                if prev is not None:
                    gap = (ts - prev) / n
                    gaps[gap] = gaps.get(gap, 0) + n
            if ended:
                m.prompt_tokens.inc(job.prompt_tokens)
                m.e2e.observe(max(0.0, time.time() - job.enqueued_ms / 1000))
                m.finished.labels(job.finish_reason or "stop").inc()
                log.info("finished", finish_reason=job.finish_reason, tokens=job.tokens,
                         **job.log_fields())
        if tokens:
            m.generation_tokens.inc(tokens)
        for gap, count in gaps.items():
            observe_many(m.itl, gap, count)
        self._stepped.clear()

    def _engine_failed(self, exc: Exception) -> EngineFailure:
        """The worker gives up on the engine: jobs the exception names (``request_ids``; every
        running job when it names none) are handed back counting a delivery, or dead-lettered
        (poison) when that was their last allowed one; the others are parked without counting
        one (the flush hands them back)."""
        self.log.error("engine step failed; handing jobs back and exiting", exc_info=exc)
        named = set(getattr(exc, "request_ids", None) or ())
        for job in [j for j in self.jobs.values() if j.in_engine]:
            try:
                self.engine.abort_request(job.job_id)
            except Exception:  # the engine is broken already; the job is handed back anyway
                pass
            job.in_engine = False
            if named and job.job_id not in named:
                job.parking = True
            else:
                self._hand_back_suspect(job, exc)
        return EngineFailure(exc)

    def _hand_back_suspect(self, job: Job, exc: Exception) -> None:
        """Release a job that may have broken the engine. Each failure raises its delivery count
        (whoever takes it next counts one), so a prompt that kills every worker is dead-lettered
        after --max-deliveries instead of crash-looping the fleet."""
        e = job.entry
        self.jobs.drop(job, "engine failure: handed back counting a delivery")
        if e.deliveries >= self.max_deliveries:
            self.outbox.reject(Rejection(
                e, ErrorCode.POISON.value, f"job dead-lettered: the engine failed on each of "
                f"its {e.deliveries} deliveries ({type(exc).__name__}: {exc})", job.job_id,
                {"entry_id": e.entry_id, "deliveries": e.deliveries}))
            return
        try:
            self.pending.release([e.key])
        except (redis.ConnectionError, redis.TimeoutError) as err:
            self.log.warning("hand-back failed; the lease will expire instead", error=str(err),
                             **job.log_fields())


def _error_code(code: str) -> ErrorCode:
    """The protocol code an engine error names (``internal`` for one the protocol lacks)."""
    try:
        return ErrorCode(code)
    except ValueError:
        return ErrorCode.INTERNAL
