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
from typing import Any, Callable

from tokenrelay.protocol.keys import Keys
from tokenrelay.worker.admission import Admission
from tokenrelay.worker.affinity import Affinity
from tokenrelay.worker.config import WorkerSettings
from tokenrelay.worker.deadletters import DeadLetterWriter
from tokenrelay.worker.drain import Drain
from tokenrelay.worker.engine_api import EngineAPI
from tokenrelay.worker.entries import EntryKey
from tokenrelay.worker.fencing import Fence
from tokenrelay.worker.intake import Intake
from tokenrelay.worker.jobs import JobTable
from tokenrelay.worker.liveness import Liveness, WorkerStatus
from tokenrelay.worker.logs import RateLimitedLog
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
    def assemble(cls, *, settings: WorkerSettings, worker_id: str, client: Any, keys: Keys,
                 engine: EngineAPI, jobs: JobTable, metrics: WorkerMetrics, log: Any,
                 log_limited: RateLimitedLog, status: Callable[[], WorkerStatus],
                 held: Callable[[], list[EntryKey]],
                 on_group_recreated: Callable[[str], None],
                 fault_point: Callable[[str], None] = no_fault) -> "Crew":
        """Wire the collaborators for ``keys`` (the queue's registered shard count).
        ``status`` and ``held`` are the loop's answers to what a heartbeat reports and what a
        lease renewal covers; ``on_group_recreated`` is told of every NOGROUP repaired;
        ``fault_point`` is the outbox's test seam (worker/outbox.py, FAULT_POINTS)."""
        s = settings
        limits = s.decode_limits()
        fence = Fence(keys, s.dedupe_ttl)
        dead = DeadLetterWriter(keys, worker_id, s.result_ttl_ms, s.dedupe_ttl,
                                s.dead_letter_maxlen, s.dead_letter_payload_bytes)
        pending = PendingList(client, keys, worker_id, on_group_recreated=on_group_recreated)
        affinity = Affinity(client, keys, worker_id, pending, limits, log, log_limited)
        intake = Intake(pending, affinity, engine, s.block_ms, s.lease_ms, log, log_limited)
        outbox = Outbox(client, jobs, pending, fence, dead, s.result_ttl_ms, metrics, log,
                        log_limited, fault_point)
        return cls(
            pending=pending, affinity=affinity, intake=intake, outbox=outbox,
            admission=Admission(client, keys, worker_id, s, limits, engine, jobs, fence, outbox,
                                pending, metrics, log),
            stepper=Stepper(engine, jobs, outbox, pending, s.max_deliveries, metrics, log),
            drain=Drain(engine, jobs, outbox, intake, affinity, pending, fence, s.drain_timeout,
                        log),
            liveness=Liveness(client, keys, worker_id, s, pending, affinity, metrics, log,
                              status, held))
