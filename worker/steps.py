"""One engine step: deltas into queued events, then (after the flush) the step's logs and
metrics; and what happens when a step raises.

Events are queued for the flush that follows at once, while logs and metrics wait until after
it (``account``): they are not on the path from the engine to the reader.
"""

from __future__ import annotations

import time
from typing import Any

import redis

from protocol.errors import ErrorCode
from worker.deadletters import Rejection
from worker.jobs import Job


class Stepper:
    def __init__(self, worker: Any) -> None:
        self.w = worker
        self._stepped: list[tuple] = []     # (job, delta, prev token time, first, ts, ended)

    def step(self) -> None:
        w = self.w
        t0 = time.perf_counter()
        try:
            deltas = w.engine.step()
        except Exception as exc:
            self._engine_failed(exc)
            return
        ts = time.time()
        w.metrics.engine_step.observe(time.perf_counter() - t0)
        for d in deltas:
            job = w.jobs.get(d.request_id)
            if job is None or not job.in_engine:
                continue
            if d.error is not None:     # the engine ended this request alone (its grammar)
                job.in_engine = False
                w.jobs.fail(job, _error_code(d.error.code), d.error.message)
                continue
            prev, open_ = job.last_token_at, job.terminal is None
            first = job.on_delta(d, ts)
            ended = open_ and job.terminal is not None   # its last choice finished
            if ended:
                job.in_engine = False
            self._stepped.append((job, d, prev, first, ts, ended))

    def account(self) -> None:
        """Logs and metrics of the last step (after its flush)."""
        m, log = self.w.metrics, self.w.log
        for job, d, prev, first, ts, ended in self._stepped:
            if first:
                m.ttft.observe(max(0.0, ts - job.enqueued_ms / 1000))
                log.debug("first_token", **job.log_fields())
            n = len(d.new_token_ids)
            if n:
                m.generation_tokens.inc(n)
                if prev is not None:
                    for _ in range(n):
                        m.itl.observe((ts - prev) / n)
            if ended:
                m.prompt_tokens.inc(job.prompt_tokens)
                m.e2e.observe(max(0.0, time.time() - job.enqueued_ms / 1000))
                m.finished.labels(job.finish_reason or "stop").inc()
                log.info("finished", finish_reason=job.finish_reason, tokens=job.tokens,
                         **job.log_fields())
        self._stepped.clear()

    def _engine_failed(self, exc: Exception) -> None:
        """A step raised. The engine may be unusable now (a CUDA error poisons the context), so
        the worker gives up on it: jobs the exception names (``request_ids``; every running job
        when it names none) are handed back counting a delivery, or dead-lettered (poison) when
        that was their last allowed one; the others are parked without counting one. The
        heartbeat reports the engine unloaded and the process exits 1 for its supervisor."""
        w = self.w
        w.log.exception("engine step failed; handing jobs back and exiting")
        named = set(getattr(exc, "request_ids", None) or ())
        for job in [j for j in w.jobs.values() if j.in_engine]:
            try:
                w.engine.abort_request(job.job_id)
            except Exception:  # the engine is broken already; the job is handed back anyway
                pass
            job.in_engine = False
            if named and job.job_id not in named:
                job.parking = True
            else:
                self._hand_back_suspect(job, exc)
        w.engine_broken = True
        w.exit_code = 1
        w.stop(force=True)

    def _hand_back_suspect(self, job: Job, exc: Exception) -> None:
        """Release a job that may have broken the engine. Each failure raises its delivery count
        (whoever takes it next counts one), so a prompt that kills every worker is dead-lettered
        after --max-deliveries instead of crash-looping the fleet."""
        w, e = self.w, job.entry
        w.jobs.drop(job, "engine failure: handed back counting a delivery")
        if e.deliveries >= w.s.max_deliveries:
            w.outbox.reject(Rejection(
                e, ErrorCode.POISON.value, f"job dead-lettered: the engine failed on each of "
                f"its {e.deliveries} deliveries ({type(exc).__name__}: {exc})", job.job_id,
                {"entry_id": e.entry_id, "deliveries": e.deliveries}))
            return
        try:
            w.pending.release([e.key])
        except (redis.ConnectionError, redis.TimeoutError) as err:
            w.log.warning("hand-back failed; the lease will expire instead", error=str(err),
                          **job.log_fields())


def _error_code(code: str) -> ErrorCode:
    """The protocol code an engine error names (``internal`` for one the protocol lacks)."""
    try:
        return ErrorCode(code)
    except ValueError:
        return ErrorCode.INTERNAL
