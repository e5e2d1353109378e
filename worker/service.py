"""The worker loop: Redis Streams in, engine steps, token streams out.

One thread runs the loop, in this order, each iteration (this file holds that order and what
the loop does with what each step reports; each step lives in the module named beside it, its
collaborators wired in worker/crew.py); a second one, the writer, builds and flushes the
events of step N while the loop's thread runs step N+1 (worker/cycle.py says how and why each
promise holds; ``--no-overlap-steps`` and a worker driven by hand do it all in series); a
third answers the gateway's ``/tokenize`` calls from the engine's tokenizer
(worker/tokenize_server.py), never touching the loop::

    liveness   heartbeat + worker id lease + drain flag, lease renewal    worker/liveness.py
    intake     own pending list after (re)connect, reclaims, new entries  worker/intake.py
    admit      decode, validate, bind identity, own, resume, start        worker/admission.py
    step       engine.step() -> one token event per job                   worker/steps.py
    flush      ONE round trip: events, cancel flags, dead letters, acks   worker/outbox.py
    account    the step's logs and metrics (off the engine-to-reader path) worker/steps.py
               (build, flush and account overlap the next step: worker/cycle.py)

Each reports what the loop must act on, and only the loop changes the worker's state: a
``Tick`` (worker id lost: exit 3; admin drain; leases lost: drop those jobs), ``StartDeferred``
(a transient error: take the batch again after the backoff), an ``EngineFailure`` (the engine
is unloaded in the heartbeat, exit 1), a ``FlushReport`` (back off, or exit 78; resume jobs
whose streams lost events).

Redis errors are classified once (worker/connection.py): transient ones (a Redis Cluster's
failover and slot moves included) pause intake and retry with backoff, keeping every job;
permanent configuration errors (a shard count other than the queue's, --cluster on against a
plain server) exit 78 after one clear line.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

from tokenrelay.engine.errors import UnsupportedModelError
from tokenrelay.heap import serve_heap, thaw_heap
from tokenrelay.protocol.keys import Keys
from tokenrelay.protocol.lanes import OUTSIDE_LAYOUT, unread_lanes
from tokenrelay.protocol.shards import ShardCountMismatch, register_shards
from tokenrelay.worker.admission import StartDeferred
from tokenrelay.worker.tokenize_server import TokenizeServer
from tokenrelay.worker.config import WorkerSettings
from tokenrelay.worker.connection import (EXIT_CONFIG, REDIS_ERRORS, Backoff, ErrorKind,
                                          PermanentRedisError, RedisClient)
from tokenrelay.worker.crew import Crew
from tokenrelay.worker.engine_api import EngineAPI, describe_engine, load_engine
from tokenrelay.worker.entries import Entry, EntryKey, own_streams
from tokenrelay.worker.jobs import JobTable
from tokenrelay.worker.liveness import Tick, WorkerStatus
from tokenrelay.worker.logs import RateLimitedLog, get_logger
from tokenrelay.worker.metrics import WorkerMetrics
from tokenrelay.worker.model_guard import serves_queue
from tokenrelay.worker.cycle import StepCycle
from tokenrelay.worker.outbox import FlushReport, no_fault
from tokenrelay.worker.redis_link import RedisLink
from tokenrelay.worker.steps import EngineFailure
from tokenrelay.worker.writer import Writer

EXIT_ID_IN_USE = 3
EXIT_ENGINE_FAILED = 1


def registered_keys(client: Any, keys: Keys, shards: Optional[int], log: Any) -> Keys:
    """The queue's keys with its registered shard count (registered here when none is; a
    different ``--shards`` is a configuration error), and a warning for each lane of jobs that
    no worker of that count reads (producers that guessed the count before they registered)."""
    try:
        count = register_shards(client, keys, shards)
    except ShardCountMismatch as exc:
        raise PermanentRedisError(str(exc)) from exc
    keys = Keys(keys.namespace, keys.queue, count)
    for lane in unread_lanes(client, keys):
        if lane.reason == OUTSIDE_LAYOUT:
            log.warning("jobs in a lane no worker reads", lane=lane.key, depth=lane.depth,
                        detail=lane.detail)
    return keys


class Worker:
    """Runs one worker; ``run()`` blocks until stopped, ``stop()`` may be called from any thread.

    The one owner of the worker's state (exit code, engine health, the Redis error being
    waited out, stopping): collaborators report outcomes (a ``Tick``, an ``EngineFailure``, a
    ``FlushReport``, ``StartDeferred``) and the loop acts on them here."""

    def __init__(self, settings: WorkerSettings, engine: Optional[EngineAPI] = None,
                 engine_factory: Callable[[WorkerSettings], EngineAPI] = load_engine,
                 fault_point: Callable[[str], None] = no_fault) -> None:
        """``fault_point`` is a test seam (worker/outbox.py, FAULT_POINTS): only
        tests/fault_worker.py passes one, to stop the worker at a point of a flush."""
        self.s = settings
        self.keys: Keys = settings.keys   # with the queue's shard count once connected
        self.worker_id = settings.resolved_worker_id()
        self.engine = engine
        self._engine_factory = engine_factory
        self.metrics = WorkerMetrics(model_name=settings.served_model())
        self.log = get_logger(worker_id=self.worker_id, queue=settings.queue)
        self.log_limited = RateLimitedLog(self.log)
        self.jobs = JobTable(engine, self.metrics, self.log)
        self.crew: Optional[Crew] = None         # made once connected (worker/crew.py)
        self.writer: Writer[FlushReport] = Writer(f"writer-{self.worker_id}")
        self.cycle: Optional[StepCycle] = None   # a step and its flush, made with the crew
        self._fault_point = fault_point
        self.tokenizing: Optional[TokenizeServer] = None   # /tokenize answers, once ready
        self.ready = threading.Event()
        self.exit_code = 0
        self.engine_broken = False
        self._stop = threading.Event()
        self._force = threading.Event()
        self.link = RedisLink(settings=settings, metrics=self.metrics, log=self.log,
                              log_limited=self.log_limited, stop=self._stop,
                              held=lambda: len(self.jobs),
                              reread=lambda: self._crew().intake.reread_own_pending())

        self.backoff: Backoff = self.link.backoff     # one object for the worker's life

    @property
    def client(self) -> Optional[RedisClient]:
        """redis.Redis or RedisCluster once connected (worker/redis_link.py), else None."""
        return self.link.client

    @property
    def redis_error(self) -> Optional[str]:
        """The transient error being waited out (the heartbeat's ``redis_error``)."""
        return self.link.error

    # ================================================================== lifecycle
    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def draining(self) -> bool:
        return self.crew is not None and self.crew.drain.active

    def stop(self, force: bool = False) -> None:
        """Begin the drain (second call or ``force``: hand back running jobs now)."""
        if self._stop.is_set() or force:
            self._force.set()
        self._stop.set()

    def run(self) -> int:
        try:
            if self.engine is None and not self._load_engine():
                return self.exit_code
            self.log.info("engine loaded", model=self.s.model, **describe_engine(self.engine))
            if not self._connect() or not self._claim_worker_id():
                return self.exit_code
            self.metrics.serve(self.s.metrics_port, self.s.metrics_host)
            serve_heap()
            # The freeze's full collection can take a second in a process holding a model:
            # beat again, so a worker that says it is ready has a fresh heartbeat.
            self._crew().liveness.heartbeat()
            if overlaps(self.s, self.engine):
                self.writer.open()
            self.tokenizing = TokenizeServer(lambda: self.client, self.keys, self.engine,
                                             self.worker_id, self.log, self.s.block_ms).start()
            self.ready.set()
            self.log.info("worker ready", lanes=self.keys.lanes(), metrics_port=self.s.metrics_port,
                          overlap_steps=self.writer.running)
            while not self._iteration_guarded():
                pass
            return self.exit_code
        except PermanentRedisError as exc:
            self.log.error(str(exc))
            self.exit_code = EXIT_CONFIG
            return self.exit_code
        except Exception:
            self.log.exception("worker crashed")
            raise
        finally:
            self._shutdown()
            thaw_heap()

    def _load_engine(self) -> bool:
        """A model that cannot be loaded (no such folder, no config.json, an unsupported
        architecture) is a configuration error: one line, exit 78, no traceback."""
        self.log.info("engine loading", model=self.s.model)
        try:
            self.engine = self.jobs.engine = self._engine_factory(self.s)
        except (OSError, UnsupportedModelError) as exc:
            self.exit_code = EXIT_CONFIG
            self.log.error("cannot load the model", model=self.s.model, error=str(exc),
                           exit_code=self.exit_code)
            return False
        return True

    def _claim_worker_id(self) -> bool:
        """The worker id (else exit 3), then its queue's model (else 78: model_guard.py)."""
        if not self._crew().liveness.claim_worker_id():
            self.exit_code = EXIT_ID_IN_USE
        elif not serves_queue(self.client, self.keys, self.worker_id, self.s, self.log):
            self.exit_code = EXIT_CONFIG
        return self.exit_code == 0

    def _shutdown(self) -> None:
        if self.tokenizing is not None:
            self.tokenizing.close()
        self.writer.close()
        self.metrics.close()
        if self.client is not None:
            if self.crew is not None:
                try:
                    self.crew.liveness.shutdown()
                except REDIS_ERRORS:
                    pass
                self.crew.pending.reset()
            self.client.close()
        self.log.info("worker stopped", exit_code=self.exit_code, held=len(self.jobs))

    def _crew(self) -> Crew:
        """The collaborators; they exist from the first successful connect on."""
        assert self.crew is not None, "the worker is not connected yet"
        return self.crew

    def _cycle(self) -> StepCycle:
        """A step and its flush (worker/cycle.py), made with the crew."""
        if self.cycle is None:
            c = self._crew()
            self.cycle = StepCycle(c.stepper, c.outbox, c.intake, self.jobs, self.writer,
                                   on_failure=self._engine_failed)
        return self.cycle

    # ================================================================== connection
    def _assemble(self) -> Crew:
        """The queue's shard count (registered by the first worker or producer, refused with
        exit 78 when --shards says otherwise), a warning for jobs in lanes no worker of that
        count reads, then the collaborators for its keys."""
        self.keys = registered_keys(self.client, self.keys, self.s.shards, self.log)
        assert self.engine is not None
        return Crew.assemble(
            settings=self.s, worker_id=self.worker_id, client=self.client, keys=self.keys,
            engine=self.engine, jobs=self.jobs, metrics=self.metrics, log=self.log,
            log_limited=self.log_limited, status=self.status, held=self.held_entries,
            on_group_recreated=self._group_recreated, fault_point=self._fault_point)

    def _connect(self) -> bool:
        """(Re)connect until it works (worker/redis_link.py); False when told to stop past the
        drain deadline."""
        return self.link.connect(self._prepare, self._may_give_up)

    def _prepare(self) -> None:
        """After each (re)connect: the collaborators (once), then groups and own pending."""
        if self.crew is None:
            self.crew = self._assemble()
        self.crew.pending.reset()
        self.link.client.ping()
        self.crew.pending.ensure_groups()
        self.crew.intake.reread_own_pending()

    def _may_give_up(self) -> bool:
        """Stopping, a reconnect may give up when forced, when nothing is held, or past the
        drain's deadline."""
        deadline = self.crew.drain.deadline if self.crew is not None else 0.0
        return self._force.is_set() or not self.jobs or time.monotonic() > deadline

    def _group_recreated(self, lane_key: str) -> None:
        if lane_key in own_streams(self.keys, self.worker_id):
            self.log.warning("own affinity stream was missing and has been recreated: another "
                             "worker took this one for dead (its heartbeat expired) and emptied "
                             "it", lane=lane_key)
            return
        self.log.error("consumer group was missing (NOGROUP) and has been recreated at 0; "
                       "Redis probably restarted without persistence", lane=lane_key)

    def _iteration_guarded(self) -> bool:
        return self.link.guarded(self._iteration, self._connect)

    # ================================================================== the loop
    def _iteration(self) -> bool:
        """One pass, in the order of the module docstring; True when the worker should exit."""
        c = self._crew()
        if self._stop.is_set() and not c.drain.active:
            c.drain.begin(self._force.is_set())
        if c.drain.active and c.drain.step(self._force.is_set()):
            return True
        self._on_tick(c.liveness.tick(draining=c.drain.active))
        busy = self.engine.has_unfinished_requests()
        if not c.drain.active and not self.backoff.paused:
            entries = c.intake.collect(block=not busy and not c.outbox.owes()
                                       and not self._cycle().owes())
            if entries:
                self._admit(entries)
        stepping = self.engine.has_unfinished_requests() and not self.backoff.paused
        self._on_flush(self._cycle().run([c.drain.parks_rider, c.intake.surplus_rider], stepping,
                                         reading=lambda: not self._stop.is_set()))
        return False

    def _admit(self, entries: list[Entry]) -> None:
        c = self._crew()
        try:
            c.admission.admit(entries, set(self.held_entries()))
        except StartDeferred as exc:   # retried as they are after the backoff
            c.intake.defer(exc.entries)
            raise exc.cause from None

    def _on_tick(self, tick: Tick) -> None:
        if tick.lost_worker_id:
            self._lost_worker_id()
            return
        if tick.redis_restarted:
            self.log.warning("redis restarted (its run id changed); re-reading own pending "
                             "entries, each held job's next write checks what its stream kept",
                             held=len(self.jobs))
            self._crew().intake.reread_own_pending()
        if tick.drain_requested and not self._stop.is_set():
            self.exit_code = tick.exit_code     # 78: another model serves the queue
            self.stop()
        for lane, entry_id in tick.lost_entries:
            self._lost_entry(lane, entry_id)

    def _on_flush(self, report: FlushReport) -> None:
        """Jobs whose streams lost events are resumed from what survived; a configuration
        error ends the worker; a transient one pauses intake, and its end resumes it."""
        if report.resume:
            self._crew().intake.defer(report.resume)
        if report.permanent is not None:
            self.link.check_permanent(report.permanent)
        if report.transient:
            self.link.transient(report.transient, ErrorKind.TRANSIENT)
        else:
            self.link.recovered()

    def _engine_failed(self, failure: EngineFailure) -> None:
        """The engine may be unusable (``failure.error``, logged by the stepper): its jobs are
        handed back already; the heartbeat now reports it unloaded and the process exits 1 for
        its supervisor."""
        self.engine_broken = True
        self.exit_code = EXIT_ENGINE_FAILED
        self.stop(force=True)

    def held_entries(self) -> list[EntryKey]:
        """(lane key, entry id) of every entry this worker holds: renewed with the lease."""
        c = self._crew()
        return [j.entry.key for j in self.jobs.values()] + c.outbox.held() + c.intake.held()

    def status(self) -> WorkerStatus:
        """What the heartbeat reports of this worker (the engine's stats also feed metrics)."""
        stats = self.engine_stats()
        return WorkerStatus(engine_loaded=not self.engine_broken, draining=self.draining,
                            held=len(self.jobs), running=int(stats.get("num_running", 0)),
                            waiting=int(stats.get("num_waiting", 0)),
                            redis_error=self.redis_error or "",
                            tool_format=tool_format(self.engine))

    def engine_stats(self) -> dict:
        try:
            stats = dict(self.engine.stats())
        except Exception:  # metrics must never take the worker down
            return {}
        self.metrics.observe_engine(stats)
        return stats

    def _lost_worker_id(self) -> None:
        """We stalled past the heartbeat TTL and another process now serves under our id: what
        we hold is its now. Abort everything and exit 3, writing and acknowledging nothing."""
        self.log.error("worker id taken over by another process; exiting without touching jobs")
        self.jobs.abort_all()
        self.jobs.clear()
        self._crew().outbox.clear()
        self.exit_code = EXIT_ID_IN_USE
        self.stop(force=True)

    def _lost_entry(self, lane: str, entry_id: str) -> None:
        """Our lease on an entry is gone (reclaimed after we stalled): stop, write nothing."""
        for job in list(self.jobs.values()):
            if job.entry.key == (lane, entry_id):
                self.jobs.drop(job, "lease lost: the entry was reclaimed by another worker")


def overlaps(settings: WorkerSettings, engine: Any) -> bool:
    """Whether the flush runs beside the next step (worker/cycle.py): ``--overlap-steps``, else
    on unless the engine runs on the CPU. Why not there: a CPU step keeps every core busy and
    holds the GIL between its ops, so the writer only waits longer for both and tokens arrive
    later (benchmarks.worker: p99 delivery 5.4-7.8 ms overlapped vs 2.1-2.5 ms in series, the
    same throughput), while beside a GPU step (a sync that frees both) the flush is hidden."""
    if settings.overlap_steps is not None:
        return settings.overlap_steps
    device = getattr(getattr(engine, "config", None), "device", None)
    return not str(device or "").startswith("cpu")


def tool_format(engine: Any) -> str:
    """What the engine's chat template does with tools (protocol/tools.py), for the
    heartbeat; "" when the engine cannot say (producers then treat it as an older worker)."""
    try:
        return str(engine.tool_call_format)
    except Exception:  # an engine without the attribute, or a template that broke: unknown
        return ""
