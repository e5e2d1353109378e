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

from worker.jobs import Job
from worker.pending import CHUNK, by_lane
from worker.scripts import ScriptPipeline


class Drain:
    def __init__(self, worker: Any) -> None:
        self.w = worker
        self.active = False
        self.deadline = 0.0

    def begin(self, force: bool) -> None:
        w = self.w
        self.active = True
        try:
            w.intake.hand_back_prefetched()
            w.affinity.hand_back_own()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            # they stay pending here; our restart or a reclaim takes them
            w.log.warning("could not hand back unstarted entries", error=str(exc))
        timeout = 0.0 if force else w.s.drain_timeout
        self.deadline = time.monotonic() + timeout
        running = sum(1 for j in w.jobs.values() if j.in_engine)
        w.log.info("draining", running=running, drain_timeout_s=timeout)

    def step(self, force: bool) -> bool:
        """While draining: True once nothing is held any more (exit)."""
        w = self.w
        if force:
            self.deadline = min(self.deadline, time.monotonic())
        if time.monotonic() >= self.deadline:
            for job in w.jobs.values():
                if job.in_engine:
                    w.engine.abort_request(job.job_id)
                    job.in_engine = False
                    job.parking = True
        if not w.jobs and not w.outbox.owes():
            return True
        if not w.engine.has_unfinished_requests() and not w.outbox.owes():
            time.sleep(0.01)
        return False

    def parks_rider(self, pipe: ScriptPipeline) -> Optional[Callable[[list], None]]:
        """Hand back parked jobs whose events are all written: release the owner record, move
        the entry to the parking consumer; queued on the flush."""
        ready = [j for j in self.w.jobs.values() if j.parking and not j.pending]
        if not ready:
            return None
        queued: list[tuple[list[Job], int]] = []
        for lane, jobs in by_lane((j.entry.lane_key, j) for j in ready).items():
            for k in range(0, len(jobs), CHUNK):
                chunk = jobs[k:k + CHUNK]
                for job in chunk:
                    self.w.fence.release(pipe, job.job_id, job.entry.shard, job.owner)
                queued.append((chunk, self.w.pending.queue_park(
                    pipe, lane, [j.entry.entry_id for j in chunk])))

        def handle(res: list) -> None:
            for jobs, i in queued:
                if isinstance(res[i], Exception):
                    self.w.log.error("hand-back failed; entries stay pending here",
                                     error=str(res[i]))
                for job in jobs:
                    self.w.jobs.pop(job.job_id, None)
                    self.w.log.info("handed back", tokens=job.tokens, **job.log_fields())
        return handle
