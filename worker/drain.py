"""Draining: on SIGTERM (or an admin's drain flag) stop reading, let running jobs finish until
--drain-timeout, then hand the rest back without counting a delivery.

A handed-back job is parked: its owner record is released and its entry moves to the parking
consumer with a huge idle time and its delivery count unchanged, so the next worker that looks
takes it at once and resumes it from its result stream. A second signal hands back at once.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import redis

from tokenrelay.protocol.scripts import ScriptPipeline
from tokenrelay.worker.affinity import Affinity
from tokenrelay.worker.engine_api import EngineAPI
from tokenrelay.worker.entries import CHUNK, by_lane
from tokenrelay.worker.fencing import Fence
from tokenrelay.worker.intake import Intake
from tokenrelay.worker.jobs import Job, JobTable
from tokenrelay.worker.outbox import Outbox
from tokenrelay.worker.pending import PendingList
from tokenrelay.worker.logs import Log


class Drain:
    """The drain: ``begin`` once, then ``step`` every iteration until it says exit."""

    def __init__(self, engine: EngineAPI, jobs: JobTable, outbox: Outbox, intake: Intake,
                 affinity: Affinity, pending: PendingList, fence: Fence, drain_timeout: float,
                 log: Log) -> None:
        self.engine = engine
        self.jobs = jobs
        self.outbox = outbox
        self.intake = intake
        self.affinity = affinity
        self.pending = pending
        self.fence = fence
        self.drain_timeout = drain_timeout
        self.log = log
        self.active = False
        self.deadline = 0.0

    def begin(self, force: bool) -> None:
        """Stop taking work: hand back what was read but not started (entries read with the
        last flush, this worker's unread routed jobs), then let running jobs run until the
        deadline (now when ``force``)."""
        self.active = True
        try:
            self.intake.hand_back_prefetched()
            self.affinity.hand_back_own()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            # they stay pending here; our restart or a reclaim takes them
            self.log.warning("could not hand back unstarted entries", error=str(exc))
        timeout = 0.0 if force else self.drain_timeout
        self.deadline = time.monotonic() + timeout
        running = sum(1 for j in self.jobs.values() if j.in_engine)
        self.log.info("draining", running=running, drain_timeout_s=timeout)

    def step(self, force: bool) -> bool:
        """While draining: True once nothing is held any more (exit)."""
        if force:
            self.deadline = min(self.deadline, time.monotonic())
        if time.monotonic() >= self.deadline:
            for job in self.jobs.values():
                if job.in_engine:
                    self.engine.abort_request(job.job_id)
                    job.in_engine = False
                    job.parking = True
        if not self.jobs and not self.outbox.owes():
            return True
        if not self.engine.has_unfinished_requests() and not self.outbox.owes():
            time.sleep(0.01)
        return False

    def parks_rider(self, pipe: ScriptPipeline) -> Optional[Callable[[list], None]]:
        """Hand back parked jobs whose events are all written: release the owner record, move
        the entry to the parking consumer; queued on the flush."""
        ready = [j for j in self.jobs.values() if j.parking and not j.pending]
        if not ready:
            return None
        queued: list[tuple[list[Job], int]] = []
        for lane, jobs in by_lane((j.entry.lane_key, j) for j in ready).items():
            for k in range(0, len(jobs), CHUNK):
                chunk = jobs[k:k + CHUNK]
                for job in chunk:
                    self.fence.release(pipe, job.job_id, job.entry.shard, job.owner)
                queued.append((chunk, self.pending.queue_park(
                    pipe, lane, [j.entry.entry_id for j in chunk])))

        def handle(res: list) -> None:
            for jobs, i in queued:
                if isinstance(res[i], Exception):
                    self.log.error("hand-back failed; entries stay pending here",
                                   error=str(res[i]))
                for job in jobs:
                    self.jobs.pop(job.job_id, None)
                    self.log.info("handed back", tokens=job.tokens, **job.log_fields())
        return handle
