"""The worker loop: Redis Streams in, engine steps, token streams out.

One thread does everything, in this order, each iteration (this file holds that order and
nothing else; each step lives in the module named beside it)::

    liveness   heartbeat + worker id lease + drain flag, lease renewal    worker/liveness.py
    intake     own pending list after (re)connect, reclaims, new entries  worker/intake.py
    admit      decode, validate, bind identity, own, resume, start        worker/admission.py
    step       engine.step() -> one token event per job                   worker/steps.py
    flush      ONE round trip: events, cancel flags, dead letters, acks   worker/outbox.py
    account    the step's logs and metrics (off the engine-to-reader path) worker/steps.py

Redis errors are classified once (worker/connection.py): transient ones (a Redis Cluster's
failover and slot moves included) pause intake and retry with backoff, keeping every job;
permanent configuration errors (a shard count other than the queue's, --cluster on against a
plain server) exit 78 after one clear line.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any, Callable, Optional

import redis

from engine.errors import UnsupportedModelError
from protocol.keys import Keys
from worker.admission import Admission
from worker.affinity import Affinity
from worker.config import WorkerSettings
from protocol import topology
from protocol.shards import ShardCountMismatch, register_shards
from worker.connection import (EXIT_CONFIG, REDIS_ERRORS, Backoff, ErrorKind,
                               PermanentRedisError, classify, connect, describe_permanent)
from worker.deadletters import DeadLetterWriter
from worker.drain import Drain
from worker.engine_api import EngineAPI, describe_engine, load_engine
from worker.fencing import Fence
from worker.intake import Intake
from worker.jobs import JobTable
from worker.liveness import Liveness
from worker.logs import RateLimitedLog, get_logger
from worker.metrics import WorkerMetrics
from worker.outbox import Outbox
from worker.pending import PendingList
from worker.steps import Stepper
from worker.token_text import TokenTexts

EXIT_ID_IN_USE = 3


def freeze_heap() -> None:
    """Move every object alive now (torch, the tokenizer, the model's modules: hundreds of
    thousands of long-lived objects) out of the garbage collector's generations.

    Why: a full collection walks all of them; measured 136 ms in the bench worker, i.e. a stall
    of every running stream whenever one landed between a step and its write. After the freeze
    collections only look at what the loop itself allocates (events, deltas), well under 1 ms.
    ``thaw_heap`` undoes it when the loop ends."""
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Hand the frozen objects back to the collector. Frozen objects are never collected, not
    even at interpreter exit, so without this, extension objects caught in reference cycles
    (triton's, imported by torch's compiler) outlive their modules and nanobind prints pages of
    "leaked instances" at exit."""
    gc.unfreeze()


class Worker:
    """Runs one worker; ``run()`` blocks until stopped, ``stop()`` may be called from any thread."""

    def __init__(self, settings: WorkerSettings, engine: Optional[EngineAPI] = None,
                 engine_factory: Callable[[WorkerSettings], EngineAPI] = load_engine) -> None:
        self.s = settings
        self.keys: Keys = settings.keys
        self.worker_id = settings.resolved_worker_id()
        self.engine = engine
        self._engine_factory = engine_factory
        self.metrics = WorkerMetrics(model_name=settings.served_model())
        self.log = get_logger(worker_id=self.worker_id, queue=settings.queue)
        self.log_limited = RateLimitedLog(self.log)
        self.ttl_ms = int(settings.result_ttl * 1000)
        self.limits = settings.decode_limits()
        self.client: Any = None                  # redis.Redis, or RedisCluster
        self.pending: Optional[PendingList] = None
        self.jobs = JobTable(engine, self.metrics, self.log)
        self.fence = Fence(self.keys, settings.dedupe_ttl)   # both made again with the
        self.outbox = Outbox(self, self._dead_letters(self.keys))   # queue's shard count
        self.intake = Intake(self)
        self.admission = Admission(self)
        self.stepper = Stepper(self)
        self.liveness = Liveness(self)
        self.drain = Drain(self)
        self.affinity = Affinity(self)
        self.backoff = Backoff()
        self.ready = threading.Event()
        self.exit_code = 0
        self.engine_broken = False
        self.redis_error: Optional[str] = None   # the transient error we are waiting out
        self._token_texts: Optional[TokenTexts] = None
        self._stop = threading.Event()
        self._force = threading.Event()

    # ================================================================== lifecycle
    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def draining(self) -> bool:
        return self.drain.active

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
            freeze_heap()
            # The freeze's full collection can take a second in a process holding a model:
            # beat again, so a worker that says it is ready has a fresh heartbeat.
            self.liveness.heartbeat()
            self.ready.set()
            self.log.info("worker ready", lanes=self.keys.lanes(), metrics_port=self.s.metrics_port)
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
        if self.liveness.claim_worker_id():
            return True
        self.exit_code = EXIT_ID_IN_USE
        return False

    def _shutdown(self) -> None:
        self.metrics.close()
        if self.client is not None:
            try:
                self.liveness.shutdown()
            except REDIS_ERRORS:
                pass
            if self.pending is not None:
                self.pending.reset()
            self.client.close()
        self.log.info("worker stopped", exit_code=self.exit_code, held=len(self.jobs))

    # ================================================================== connection
    def _use_keys(self, keys: Keys) -> None:
        """Everything that names keys, for ``keys`` (its shard count is part of every key)."""
        self.keys = keys
        self.fence = Fence(keys, self.s.dedupe_ttl)
        self.outbox.dead = self._dead_letters(keys)

    def _dead_letters(self, keys: Keys) -> DeadLetterWriter:
        s = self.s
        return DeadLetterWriter(keys, self.worker_id, self.ttl_ms, s.dedupe_ttl,
                                s.dead_letter_maxlen, s.dead_letter_payload_bytes)

    def _resolve_shards(self) -> None:
        """The queue's shard count: registered by the first worker, refused (exit 78) when
        --shards says otherwise; then the pending lists of every shard."""
        try:
            shards = register_shards(self.client, self.keys, self.s.shards)
        except ShardCountMismatch as exc:
            raise PermanentRedisError(str(exc)) from exc
        self._use_keys(Keys(self.keys.namespace, self.keys.queue, shards))
        self.pending = PendingList(self.client, self.keys, self.worker_id,
                                   on_group_recreated=self._group_recreated)

    def _connect(self) -> bool:
        """(Re)connect until it works; False when told to stop past the drain deadline."""
        while True:
            try:
                if self.client is None:
                    self.client = connect(self.s.redis_url, self.s.block_ms, self.s.cluster)
                else:
                    topology.refresh(self.client)   # a failover may have moved every slot
                if self.pending is None:
                    self._resolve_shards()
                self.pending.reset()
                self.client.ping()
                self.pending.ensure_groups()
                self.intake.need_own_pending = True
                if self.backoff.succeeded():
                    self.metrics.redis_reconnects.inc()
                    self.log.info("redis reconnected")
                return True
            except (*REDIS_ERRORS, topology.ClusterModeError) as exc:
                self._check_permanent(exc)
                if self._stop.is_set() and (self._force.is_set() or not self.jobs
                                            or time.monotonic() > self.drain.deadline):
                    self.log.warning("giving up on redis while stopping", error=str(exc),
                                     held=len(self.jobs))
                    return False
                delay = self.backoff.failed()
                self.log_limited("warning", "redis unavailable, retrying", error=str(exc),
                                 retry_in_s=round(delay, 3))
                self._stop.wait(delay)

    def _check_permanent(self, exc: BaseException) -> None:
        if classify(exc) is ErrorKind.PERMANENT:
            raise PermanentRedisError(describe_permanent(exc, self.s.redis_url)) from exc

    def _group_recreated(self, lane_key: str) -> None:
        if lane_key in self.affinity.own:
            self.log.warning("own affinity stream was missing and has been recreated: another "
                             "worker took this one for dead (its heartbeat expired) and emptied "
                             "it", lane=lane_key)
            return
        self.log.error("consumer group was missing (NOGROUP) and has been recreated at 0; "
                       "Redis probably restarted without persistence", lane=lane_key)

    def _iteration_guarded(self) -> bool:
        try:
            done = self._iteration()
        except REDIS_ERRORS as exc:
            self._check_permanent(exc)
            self.jobs.mark_unsure()   # a failover may have lost writes we saw acknowledged
            if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
                self.log_limited("warning", "redis connection lost", error=str(exc))
                return not self._connect()
            self._transient(str(exc), classify(exc))
            return False
        if self.outbox.permanent is not None:
            self._check_permanent(self.outbox.permanent)
        if self.outbox.transient:
            self._transient(self.outbox.transient, ErrorKind.TRANSIENT)
        elif not self.backoff.paused and self.backoff.succeeded():
            self.redis_error = None
            self.log.info("redis recovered; intake resumed")
        return done

    def _transient(self, error: str, kind: ErrorKind) -> None:
        """Wait out an error: intake pauses, every held job stays held and is retried. A
        cluster error (CLUSTERDOWN, MOVED, an uncovered slot) means the slot map is stale."""
        self.redis_error = error
        self.jobs.mark_unsure()
        topology.refresh(self.client)
        delay = self.backoff.failed()
        self.log_limited("warning", "redis command failed; pausing intake and retrying",
                         error=error, kind=kind.value, retry_in_s=round(delay, 3),
                         held=len(self.jobs))
        if kind is not ErrorKind.TRANSIENT:
            self.intake.need_own_pending = True
        self._stop.wait(delay)

    # ================================================================== the loop
    def _iteration(self) -> bool:
        """One pass; returns True when the worker should exit."""
        if self._stop.is_set() and not self.drain.active:
            self.drain.begin(self._force.is_set())
        if self.drain.active and self.drain.step(self._force.is_set()):
            return True
        self.liveness.tick(self._lost_worker_id, self._lost_entry, self._drain_requested)
        busy = self.engine.has_unfinished_requests()
        if not self.drain.active and not self.backoff.paused:
            entries = self.intake.collect(block=not busy and not self.outbox.owes())
            if entries:
                self.admission.admit(entries)
        if self.engine.has_unfinished_requests() and not self.backoff.paused:
            self.stepper.step()
        try:
            self.outbox.flush([self.drain.parks_rider, self.intake.surplus_rider],
                              self.intake.prefetch_rider)
        finally:
            self.stepper.account()
        return False

    def held_entries(self) -> list[tuple[str, str]]:
        """(lane key, entry id) of every entry this worker holds: renewed with the lease."""
        return ([j.entry.key for j in self.jobs.values()] + self.outbox.held()
                + self.intake.held())

    def token_texts(self) -> TokenTexts:
        """The text and bytes of the engine's tokens, for jobs that ask for logprobs (made on
        first use: a worker whose jobs never ask decodes nothing)."""
        if self._token_texts is None:
            self._token_texts = TokenTexts(self.engine.tokenizer)
        return self._token_texts

    def engine_stats(self) -> dict:
        try:
            stats = dict(self.engine.stats())
        except Exception:  # metrics must never take the worker down
            return {}
        self.metrics.observe_engine(stats)
        return stats

    def _drain_requested(self) -> None:
        if not self._stop.is_set():
            self.log.info("drain requested by admin")
            self.stop()

    def _lost_worker_id(self) -> None:
        """We stalled past the heartbeat TTL and another process now serves under our id: what
        we hold is its now. Abort everything and exit 3, writing and acknowledging nothing."""
        self.log.error("worker id taken over by another process; exiting without touching jobs")
        self.jobs.abort_all()
        self.jobs.clear()
        self.outbox.clear()
        self.exit_code = EXIT_ID_IN_USE
        self.stop(force=True)

    def _lost_entry(self, lane: str, entry_id: str) -> None:
        """Our lease on an entry is gone (reclaimed after we stalled): stop, write nothing."""
        for job in list(self.jobs.values()):
            if job.entry.key == (lane, entry_id):
                self.jobs.drop(job, "lease lost: the entry was reclaimed by another worker")
