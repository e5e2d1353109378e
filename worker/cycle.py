"""One engine step and the flush of what it produced: in series, or overlapped with the writer.

In series (a worker driven by hand, ``--no-overlap-steps``, or no step to overlap): step, turn
the deltas into events, flush, then the step's metrics. Overlapped (``Worker.run`` opened the
writer, worker/writer.py): the loop's thread runs step N+1 while the writer's thread builds
step N's events, flushes them with everything else owed, and accounts step N. The flush is
awaited before the loop goes on, so one step's events at most are in flight and a Redis slower
than the engine holds the engine back (never a growing buffer). During the overlap the loop's
thread touches nothing but the engine, and the writer never calls the engine:

* aborts the flush decides (cancel flags, lost ownership, streams gone) wait for the step's end
  (``JobTable.stepping``); the job leaves ``in_engine`` at once, so the step's delta for it is
  ignored when it is built: no token of a cancelled or refused job is ever written;
* the next read of new entries is sized before the step (``Intake.prefetch``);
* a step that raised is handled by the loop's thread once the flush has landed;
* a step's deltas go only to the Job objects that ran it (``StepOutcome.ran``): a job the
  flush dropped and the loop admitted again under the same id (resumed after a failover lost
  its events) never takes its old run's deltas.

Every other Redis call of the loop (heartbeat, lease renewal, reads, admission) happens between
two overlaps, with no flush in flight, so the per-job order of writes and the fencing are
exactly those of the serial loop: each flush is prepared only after the previous one's replies
were applied.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from tokenrelay.worker.intake import Intake
from tokenrelay.worker.jobs import JobTable
from tokenrelay.worker.outbox import FlushReport, Outbox, Rider
from tokenrelay.worker.steps import EngineFailure, Stepper, StepOutcome
from tokenrelay.worker.writer import Writer


class StepCycle:
    """Runs a step and its flush (see the module docstring); ``run`` returns the flush's report,
    an engine failure goes to ``on_failure`` (the loop's decision) before anything else."""

    def __init__(self, stepper: Stepper, outbox: Outbox, intake: Intake, jobs: JobTable,
                 writer: Writer[FlushReport],
                 on_failure: Callable[[EngineFailure], None]) -> None:
        self.stepper = stepper
        self.outbox = outbox
        self.intake = intake
        self.jobs = jobs
        self.writer = writer
        self.on_failure = on_failure

    def owes(self) -> bool:
        """A step's deltas are not built into events yet: the loop must not block on a read."""
        return self.stepper.owes()

    def run(self, riders: list[Rider], stepping: bool,
            reading: Callable[[], bool]) -> FlushReport:
        """``stepping``: run an engine step; ``reading()``: the flush may carry the next read
        of new entries (not once the worker is stopping)."""
        if stepping and self.writer.running:
            return self._overlapped(riders, reading)
        return self._in_series(riders, stepping, reading)

    def _in_series(self, riders: list[Rider], stepping: bool,
                   reading: Callable[[], bool]) -> FlushReport:
        stepper = self.stepper
        cpu = time.thread_time()
        failure = stepper.build(stepper.detach())   # what an overlapped step left
        if stepping and failure is None:
            spent = time.thread_time() - cpu
            stepper.run(stepper.running())           # the engine's CPU is not the events'
            cpu = time.thread_time() - spent
            failure = stepper.build(stepper.detach())
        if failure is not None:
            self.on_failure(failure)
        try:
            return self.outbox.flush(riders, self.intake.prefetch_rider if reading() else None)
        finally:
            stepper.account()
            stepper.metrics.events_cpu.inc(time.thread_time() - cpu)

    def _overlapped(self, riders: list[Rider], reading: Callable[[], bool]) -> FlushReport:
        built = self.stepper.detach()
        read = self.intake.prefetch() if reading() else None
        ran = self.stepper.running()
        with self.jobs.stepping():
            self.writer.start(lambda: self._flush(built, riders, read))
            try:
                self.stepper.run(ran)
            finally:
                report = self.writer.wait()
        if self.stepper.failed():
            failure = self.stepper.build(self.stepper.detach())
            assert failure is not None
            self.on_failure(failure)
        return report

    def _flush(self, built: Optional[StepOutcome], riders: list[Rider],
               read: Optional[Rider]) -> FlushReport:
        """The writer's job: a step's deltas into events, one flush, the step's metrics; its
        CPU time is the ``events_cpu`` metric (what a GPU step has to hide)."""
        cpu = time.thread_time()
        self.stepper.build(built)    # never a failure: the loop builds those in its thread
        try:
            return self.outbox.flush(riders, read)
        finally:
            self.stepper.account()
            self.stepper.metrics.events_cpu.inc(time.thread_time() - cpu)
