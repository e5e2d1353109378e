"""Who gets what: the worker's collaborators, wired once, each given only what it uses.

The loop (worker/service.py) decides the order of a step and acts on what each collaborator
reports; the collaborators below never reach the loop's state, only each other through the
typed references given here (admission and the stepper queue rejections on the outbox, intake
and the drain take a dead worker's or their own routed jobs through affinity, ...). They are
made once the client is connected and the queue's shard count is known: every key they name
carries its shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tokenrelay.protocol.keys import Keys
from tokenrelay.worker.admission import Admission
from tokenrelay.worker.affinity import Affinity
from tokenrelay.worker.config import WorkerSettings
from tokenrelay.worker.connection import RedisClient
from tokenrelay.worker.deadletters import DeadLetterWriter
from tokenrelay.worker.drain import Drain
from tokenrelay.worker.engine_api import EngineAPI
from tokenrelay.worker.entries import EntryKey
from tokenrelay.worker.fencing import Fence
from tokenrelay.worker.intake import Intake
from tokenrelay.worker.jobs import JobTable
from tokenrelay.worker.liveness import Liveness, WorkerStatus
from tokenrelay.worker.logs import Log, RateLimitedLog
from tokenrelay.worker.metrics import WorkerMetrics
from tokenrelay.worker.outbox import Outbox, no_fault
from tokenrelay.worker.pending import PendingList
from tokenrelay.worker.steps import Stepper


@dataclass(frozen=True)
class Crew:
    """The collaborators of one connected worker (see the module docstring)."""

    pending: PendingList
    affinity: Affinity
    intake: Intake
    outbox: Outbox
    admission: Admission
    stepper: Stepper
    drain: Drain
    liveness: Liveness

    @classmethod
    def assemble(cls, *, settings: WorkerSettings, worker_id: str, client: RedisClient,
                 keys: Keys, engine: EngineAPI, jobs: JobTable, metrics: WorkerMetrics,
                 log: Log, log_limited: RateLimitedLog, status: Callable[[], WorkerStatus],
                 held: Callable[[], list[EntryKey]],
                 on_group_recreated: Callable[[str], None],
                 fault_point: Callable[[str], None] = no_fault) -> "Crew":
        """Wire the collaborators for ``keys`` (the queue's registered shard count), every
        argument by keyword so two of one type cannot be swapped unseen.
        ``status`` and ``held`` are the loop's answers to what a heartbeat reports and what a
        lease renewal covers; ``on_group_recreated`` is told of every NOGROUP repaired;
        ``fault_point`` is the outbox's test seam (worker/outbox.py, FAULT_POINTS)."""
        s = settings
        limits = s.decode_limits()
        fence = Fence(keys=keys, dedupe_ttl_s=s.dedupe_ttl)
        dead = DeadLetterWriter(keys=keys, worker_id=worker_id, ttl_ms=s.result_ttl_ms,
                                dedupe_ttl_s=s.dedupe_ttl, maxlen=s.dead_letter_maxlen,
                                payload_bytes=s.dead_letter_payload_bytes)
        pending = PendingList(client=client, keys=keys, worker_id=worker_id,
                              on_group_recreated=on_group_recreated)
        affinity = Affinity(client=client, keys=keys, worker_id=worker_id, pending=pending,
                            limits=limits, log=log, log_limited=log_limited)
        intake = Intake(pending=pending, affinity=affinity, engine=engine, block_ms=s.block_ms,
                        lease_ms=s.lease_ms, log=log, log_limited=log_limited)
        outbox = Outbox(client=client, jobs=jobs, pending=pending, fence=fence, dead=dead,
                        ttl_ms=s.result_ttl_ms, metrics=metrics, log=log,
                        log_limited=log_limited, fault_point=fault_point)
        return cls(
            pending=pending, affinity=affinity, intake=intake, outbox=outbox,
            admission=Admission(client=client, keys=keys, worker_id=worker_id, settings=s,
                                limits=limits, engine=engine, jobs=jobs, fence=fence,
                                outbox=outbox, pending=pending, metrics=metrics, log=log),
            stepper=Stepper(engine=engine, jobs=jobs, outbox=outbox, pending=pending,
                            max_deliveries=s.max_deliveries, metrics=metrics, log=log),
            drain=Drain(engine=engine, jobs=jobs, outbox=outbox, intake=intake,
                        affinity=affinity, pending=pending, fence=fence,
                        drain_timeout=s.drain_timeout, log=log),
            liveness=Liveness(client=client, keys=keys, worker_id=worker_id, settings=s,
                              pending=pending, affinity=affinity, metrics=metrics, log=log,
                              status=status, held=held))
