"""The service loop: Redis Streams in, engine steps, token streams out.

One thread does everything, in this order, each iteration::

    housekeeping   heartbeat, lease renewal, reclaim (F's LeaseKeeper), parked hand-backs
    intake         own pending list first after (re)connect, then up to engine.free_capacity()
                   new entries, urgent lane first (read along with the previous flush while
                   busy); block on Redis only when the engine is idle
    admit          one pipeline: take ownership, read cancel flag, read the result stream
                   (resume); validate; engine.add_request; queue the ``started`` event
    step           engine.step() -> one token event per job (plus done when it finished)
    flush          ONE round trip: one script call writes every job's fenced event batch and
                   reads every running job's cancel flag; plus dead letters, the acks owed by
                   the previous flush, and the next read of new entries
    account        the step's logs and metrics (kept off the engine-to-reader path)

Acks ride one flush behind the terminal write they depend on, so an entry is never acknowledged
unless its terminal event is known to be stored, at no extra round trip. Every write in a flush
is idempotent, so after a connection error the loop reconnects (with backoff) and flushes the
same batch again. Cancel flags read in a flush abort the job before the next step.
"""

from __future__ import annotations

import gc
import random
import socket
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Optional

import msgpack
import redis
from pydantic import ValidationError
from redis.backoff import NoBackoff
from redis.retry import Retry

from engine.errors import InvalidRequestError, PromptTooLongError
from producer_sdk.protocol import (DeadLetter, ErrorCode, ErrorEvent, FinishReason, JobRequest,
                                   ProtocolError, decode_job, describe_validation_error,
                                   encode_event, now_ms)
from worker.config import WorkerSettings
from worker.fencing import (AckStatus, Fence, ScriptPipeline, WriteStatus, new_owner_value,
                            parse_ack_codes, parse_step_reply, parse_write_status)
from worker.intake import Entry, Intake
from worker.jobs import Job
from worker.logs import get_logger
from worker.metrics import WorkerMetrics
from worker.recovery import JobProgress, progress_from_entries

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)
MAX_WRITE_FAILURES = 3
STEP_WRITE_CHUNK = 128   # jobs per write_step call: bounds how long one script holds Redis

try:  # F's seams (worker/leases.py, worker/admin.py); the worker runs without them
    from worker.leases import (LeaseKeeper, WorkerIdInUse, WorkerIdLease,  # type: ignore
                               make_dead_letter)
except ImportError:  # pragma: no cover
    LeaseKeeper = make_dead_letter = WorkerIdLease = None  # type: ignore
    WorkerIdInUse = RuntimeError  # type: ignore
try:
    from worker.admin import clear_drain, drain_key  # type: ignore
except ImportError:  # pragma: no cover
    clear_drain = drain_key = None  # type: ignore


class EngineBroken(RuntimeError):
    """The engine failed many steps in a row: stop taking jobs, hand back the rest, exit 1."""


@dataclass
class Rejection:
    """An entry whose payload is not a valid v1 job: dead-lettered, plus an error event on the
    job's stream when a job id could be read and no one else owns that job."""

    entry: Entry
    job_id: Optional[str]
    code: str
    message: str
    owner: str
    metadata: dict


@dataclass
class OwedAck:
    lane_key: str
    entry_id: str
    job_id: Optional[str]
    reason: str


def resume_state(token_ids: list[int], text: str) -> Any:
    """The engine's ResumeState, wherever the engine defines it (duck-typed fallback)."""
    for mod in ("engine.outputs", "engine.llm_engine", "engine"):  # outputs: no torch import
        try:
            cls = getattr(__import__(mod, fromlist=["ResumeState"]), "ResumeState")
            return cls(output_token_ids=list(token_ids), output_text=text)
        except (ImportError, AttributeError):
            continue
    from worker.testing import FakeResumeState
    return FakeResumeState(list(token_ids), text)


def load_engine(settings: WorkerSettings) -> Any:
    """Build the engine named by ``--model``; ``fake:k=v,...`` builds the test FakeEngine."""
    if not settings.model:
        raise ValueError("--model (or TOKENRELAY_MODEL) is required")
    if settings.model.startswith("fake:"):
        from worker.testing import FakeEngine
        kw = dict(p.split("=", 1) for p in settings.model[5:].split(",") if p)
        return FakeEngine(max_num_seqs=int(kw.get("max_num_seqs", settings.max_num_seqs or 8)),
                          step_delay=float(kw.get("step_delay", 0.0)),
                          max_model_len=int(kw.get("max_model_len", settings.max_model_len or 4096)))
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    return LLMEngine(EngineConfig(**settings.engine_kwargs()))


def freeze_heap() -> None:
    """Move every object alive now (torch, the tokenizer, the model's modules: hundreds of
    thousands of long-lived objects) out of the garbage collector's generations.

    Why: a full collection walks all of them; measured 136 ms in the bench worker, i.e. a stall
    of every running stream whenever one landed between a step and its write. After the freeze
    collections only look at what the loop itself allocates (events, deltas), well under 1 ms."""
    gc.collect()
    gc.freeze()


def connect(url: str, block_ms: int = 0) -> redis.Redis:
    """A client without redis-py's silent retries: a retried XREADGROUP could lose the entries
    of the lost reply, so connection errors reach the loop, which re-reads its pending list."""
    return redis.Redis.from_url(url, protocol=2, socket_connect_timeout=2.0,
                                socket_timeout=max(5.0, block_ms / 1000.0 + 5.0),
                                retry=Retry(NoBackoff(), 0), health_check_interval=0)


class Worker:
    """Runs one worker; ``run()`` blocks until stopped, ``stop()`` may be called from any thread."""

    def __init__(self, settings: WorkerSettings, engine: Any = None,
                 engine_factory: Callable[[WorkerSettings], Any] = load_engine,
                 lease_keeper_factory: Optional[Callable[..., Any]] = None) -> None:
        self.s = settings
        self.keys = settings.keys
        self.worker_id = settings.resolved_worker_id()
        self.engine = engine
        self._engine_factory = engine_factory
        self._lease_factory = lease_keeper_factory or LeaseKeeper
        self.metrics = WorkerMetrics()
        self.log = get_logger(worker_id=self.worker_id, queue=settings.queue)
        self.fence = Fence(self.keys, self.worker_id)
        self.ttl_ms = int(settings.result_ttl * 1000)
        self.client: Optional[redis.Redis] = None
        self.intake: Optional[Intake] = None
        self.leases: Any = None
        self.jobs: dict[str, Job] = {}
        self.rejections: list[Rejection] = []
        self.owed_acks: list[OwedAck] = []
        self.ready = threading.Event()
        self.exit_code = 0
        self._stop = threading.Event()
        self._force = threading.Event()
        self._draining = False
        self._drain_deadline = 0.0
        self._need_pending = True
        self._next = defaultdict(float)     # housekeeping task -> next due (monotonic)
        self._engine_failures = 0
        self._engine_broken = False
        self._id_lease: Any = None          # F's WorkerIdLease: one live process per worker id
        self._redis_errors = 0
        self._stepped: list[tuple] = []     # (job, delta, prev token time, first, ts) of a step
        self._prefetched: Optional[list[Entry]] = None   # read along with the last flush
        self._started_ms = now_ms()

    # ================================================================== lifecycle
    def stop(self, force: bool = False) -> None:
        """Begin the drain (second call or ``force``: hand back running jobs now)."""
        if self._stop.is_set() or force:
            self._force.set()
        self._stop.set()

    def run(self) -> int:
        try:
            if self.engine is None:
                self.log.info("engine loading", model=self.s.model)
                self.engine = self._engine_factory(self.s)
            from worker.testing import maybe_inject_faults  # TOKENRELAY_FAULT_INJECT (tests)
            self.engine = maybe_inject_faults(self.engine)
            self.log.info("engine loaded")
            if not self._connect_with_backoff():
                return 0
            if not self._claim_worker_id():
                return self.exit_code
            self.metrics.serve(self.s.metrics_port, self.s.metrics_host)
            freeze_heap()
            self.ready.set()
            self.log.info("worker ready", lanes=self.keys.lanes(), metrics_port=self.s.metrics_port)
            while not self._iteration_guarded():
                pass
            return self.exit_code
        except Exception:
            self.log.exception("worker crashed")
            raise
        finally:
            self._shutdown()

    def _iteration_guarded(self) -> bool:
        try:
            done = self._iteration()
            self._redis_errors = 0
            return done
        except REDIS_DOWN as exc:
            self.log.warning("redis connection lost", error=str(exc))
            return not self._connect_with_backoff()
        except redis.RedisError as exc:  # e.g. a lane key of the wrong type: retry, never crash
            self._redis_errors += 1
            delay = min(5.0, 0.05 * 2 ** min(self._redis_errors, 7))
            self.log.error("redis command failed; retrying", error=f"{type(exc).__name__}: {exc}",
                           retry_in_s=delay)
            self._need_pending = True
            self._stop.wait(delay)
            return False

    def _shutdown(self) -> None:
        self.metrics.close()
        if self.client is not None:
            try:
                if self._id_lease is None:
                    self.client.delete(self.keys.heartbeat(self.worker_id))
                if self._id_lease is None or self._id_lease.held:
                    self.client.zrem(self.keys.workers, self.worker_id)
                if self._id_lease is not None:
                    self._id_lease.release()  # only if still ours, never a successor's
            except REDIS_DOWN:
                pass
            self.client.close()
        self.log.info("worker stopped", exit_code=self.exit_code, held=len(self.jobs))

    # ================================================================== connection
    def _connect_with_backoff(self) -> bool:
        """(Re)connect until it works; False when told to stop past the drain deadline."""
        delay = 0.05
        while True:
            try:
                if self.client is None:
                    self.client = connect(self.s.redis_url, self.s.block_ms)
                    self.intake = Intake(self.client, self.keys, self.worker_id,
                                         on_group_recreated=self._group_recreated)
                self.client.ping()
                self.intake.ensure_groups()
                self._setup_leases()
                self._need_pending = True
                if delay > 0.05:
                    self.metrics.redis_reconnects.inc()
                    self.log.info("redis reconnected")
                return True
            except REDIS_DOWN as exc:
                if self._stop.is_set() and (self._force.is_set() or not self.jobs
                                            or time.monotonic() > self._drain_deadline):
                    self.log.warning("giving up on redis while stopping", error=str(exc),
                                     held=len(self.jobs))
                    return False
                self.log.warning("redis unreachable, retrying", error=str(exc),
                                 retry_in_s=round(delay, 3), url=_safe_url(self.s.redis_url))
                self._stop.wait(delay * (0.5 + random.random()))
                delay = min(delay * 2, 5.0)

    def _group_recreated(self, lane_key: str) -> None:
        self.log.error("consumer group was missing (NOGROUP) and has been recreated at 0; "
                       "Redis probably restarted without persistence", lane=lane_key)

    def _setup_leases(self) -> None:
        if clear_drain is not None and not self.ready.is_set():
            clear_drain(self.client, self.keys, self.worker_id)  # a flag for our predecessor
        if self._lease_factory is None or self.leases is not None:
            return
        dead_letter = (make_dead_letter(self.client, self.keys, self.worker_id, self.ttl_ms)
                       if make_dead_letter is not None else None)
        self.leases = self._lease_factory(self.client, self.keys, self.worker_id,
                                          self.s.lease_ms, self.s.max_deliveries, dead_letter)

    # ================================================================== the loop
    def _iteration(self) -> bool:
        """One pass; returns True when the worker should exit."""
        if self._stop.is_set() and not self._draining:
            self._begin_drain()
        if self._draining and self._drain_step():
            return True
        self._housekeeping()
        busy = self.engine.has_unfinished_requests()
        if not self._draining:
            self._intake(block=not busy and not self._owes_writes())
        if self.engine.has_unfinished_requests():
            self._step()
        try:
            self._flush()
        finally:
            self._account()
        return False

    def _owes_writes(self) -> bool:
        return bool(self.owed_acks or self.rejections
                    or any(j.pending or j.terminal or not j.in_engine for j in self.jobs.values()))

    # ------------------------------------------------------------------ housekeeping
    def _due(self, task: str, every_s: float) -> bool:
        now = time.monotonic()
        if now < self._next[task]:
            return False
        self._next[task] = now + every_s
        return True

    def _housekeeping(self) -> None:
        hb = self.s.heartbeat_ms / 1000.0
        if self._due("heartbeat", hb):
            self._heartbeat()
        if self._due("renew", self.s.lease_ms / 3000.0):
            self._renew()
        if not self._draining and self._due("lane_stats", 5 * hb):
            for lane, (lag, pending) in self.intake.lane_stats().items():
                self.metrics.stream_lag.labels(lane).set(lag)
                self.metrics.stream_pending.labels(lane).set(pending)

    def _claim_worker_id(self) -> bool:
        """One live process per worker id: two under one consumer name would share one pending
        list. False (exit code 3) when a live worker holds the id."""
        if WorkerIdLease is None:
            return True
        self._id_lease = WorkerIdLease(self.client, self.keys, self.worker_id,
                                       5 * self.s.heartbeat_ms)
        try:
            self._id_lease.acquire()
        except WorkerIdInUse as exc:
            self.log.error("worker id in use; exiting", error=str(exc))
            self.exit_code = 3
            return False
        self._heartbeat()  # the claim created the hash: fill it in before anyone reads it
        return True

    def _lost_worker_id(self) -> None:
        """We stalled past the heartbeat TTL and another process now serves under our id: what
        we hold is its now. Abort everything and exit 3, writing and acknowledging nothing."""
        self.log.error("worker id taken over by another process; exiting without touching jobs")
        for job in self.jobs.values():
            if job.in_engine:
                self.engine.abort_request(job.job_id)
        self.jobs.clear()
        self.owed_acks.clear()
        self.rejections.clear()
        self.exit_code = 3
        self.stop(force=True)

    def _heartbeat(self) -> None:
        if self._id_lease is not None and not self._id_lease.still_mine():
            self._lost_worker_id()
            return
        stats = self._engine_stats()
        pipe = self.client.pipeline(transaction=False)
        key = self.keys.heartbeat(self.worker_id)
        pipe.hset(key, mapping={
            "ts": now_ms(), "engine_loaded": int(not self._engine_broken), "pid": _pid(), "host": socket.gethostname(),
            "queue": self.s.queue, "model": str(self.s.model), "started_ms": self._started_ms,
            "draining": int(self._draining), "held": len(self.jobs),
            "running": stats.get("num_running", 0), "waiting": stats.get("num_waiting", 0)})
        pipe.pexpire(key, 5 * self.s.heartbeat_ms)
        pipe.zadd(self.keys.workers, {self.worker_id: now_ms()})
        if drain_key is not None:
            pipe.exists(drain_key(self.keys, self.worker_id))
        res = pipe.execute()
        if drain_key is not None and res[-1] and not self._stop.is_set():
            self.log.info("drain requested by admin")
            self.stop()

    def _engine_stats(self) -> dict:
        try:
            stats = self.engine.stats()
        except Exception:  # metrics must never take the worker down
            return {}
        self.metrics.observe_engine(stats)
        return stats

    def held_entries(self) -> list[tuple[str, str]]:
        """(lane key, entry id) of every entry this worker holds: F's LeaseKeeper renews them."""
        held = [(j.entry.lane_key, j.entry.entry_id) for j in self.jobs.values()]
        held += [(r.entry.lane_key, r.entry.entry_id) for r in self.rejections]
        held += [(a.lane_key, a.entry_id) for a in self.owed_acks]
        return held

    def _renew(self) -> None:
        held = self.held_entries()
        if not held:
            return
        if self.leases is not None:
            for lane, entry_id in self.leases.renew(held) or []:
                self._lost_entry(lane, entry_id)
            return
        pipe = ScriptPipeline(self.client)
        by_lane: dict[str, list[str]] = defaultdict(list)
        for lane, entry_id in held:
            by_lane[lane].append(entry_id)
        for lane, ids in by_lane.items():
            self.fence.renew(pipe, lane, ids)
        pipe.execute()

    def _lost_entry(self, lane: str, entry_id: str) -> None:
        """Our lease on an entry is gone (reclaimed after we stalled): stop, write nothing."""
        for job in list(self.jobs.values()):
            if job.entry.lane_key == lane and job.entry.entry_id == entry_id:
                self._drop(job, "lease lost: the entry was reclaimed by another worker", ack=False)

    # ------------------------------------------------------------------ intake
    def _capacity(self) -> int:
        try:
            return max(0, int(self.engine.free_capacity()))
        except Exception:
            return 0

    def _intake(self, block: bool) -> None:
        if self._need_pending:
            own = self.intake.read_own_pending()
            self._need_pending = False
            if own:
                self.log.info("re-reading own pending entries", count=len(own))
                self._admit(own)
        prefetched, self._prefetched = self._prefetched, None
        entries: list[Entry] = list(prefetched or [])
        cap = self._capacity() - len(entries)
        if cap > 0 and self.leases is not None and self._due(
                "reclaim", max(0.2, self.s.lease_ms / 6000.0)):
            entries += [_entry_of(c, self.intake) for c in self.leases.reclaim(cap)]
        cap = self._capacity() - len(entries)
        if cap > 0 and (block or self._due("parked", self.s.heartbeat_ms / 1000.0)):
            entries += self.intake.claim_parked(cap)
        cap = self._capacity() - len(entries)
        if cap > 0 and (prefetched is None or (block and not entries)):
            entries += self.intake.read_new(cap, self.s.block_ms if block and not entries else 0)
        if entries:
            self._admit(entries)

    # ------------------------------------------------------------------ admission
    def _admit(self, entries: list[Entry]) -> None:
        held = set(self.held_entries())
        fresh: list[tuple[Entry, JobRequest]] = []
        recount: list[tuple[str, str, int]] = []
        for e in entries:
            if (e.lane_key, e.entry_id) in held:
                if e.source == "pending":  # our re-read after a reconnect counted a delivery
                    recount.append((e.lane_key, e.entry_id, e.deliveries - 1))
                continue
            held.add((e.lane_key, e.entry_id))
            if e.fields is None:
                self.log.warning("pending entry was deleted from the stream; acknowledging it",
                                 entry_id=e.entry_id, lane=e.lane)
                self.owed_acks.append(OwedAck(e.lane_key, e.entry_id, None, "deleted"))
                continue
            if self.leases is not None and self.leases.over_limit(e.deliveries):
                self.leases.dead_letter_entry(  # e.g. a same-id restart loop on a poison job
                    e.lane_key, e.entry_id, e.fields, e.deliveries,
                    f"delivered {e.deliveries} times, more than max_deliveries="
                    f"{self.s.max_deliveries}; each holder died or failed before finishing it")
                continue
            try:
                req = self._decode(e)
            except ProtocolError as exc:
                self.log.info("received", job_id=exc.job_id, entry_id=e.entry_id, lane=e.lane,
                              source=e.source, deliveries=e.deliveries)
                self._reject(e, exc)
                continue
            self.log.info("received", job_id=req.job_id, entry_id=e.entry_id, lane=e.lane,
                          source=e.source, deliveries=e.deliveries)
            if req.job_id in self.jobs or any(j.job_id == req.job_id for _, j in fresh):
                self._reject(e, ProtocolError(f"job_id {req.job_id!r} is already running on "
                                              f"this worker (entry submitted twice?)"))
                continue
            fresh.append((e, req))
        if recount and self.leases is not None:
            self.leases.restore_counts(recount)
        if fresh:
            self._start_all(fresh)

    def _decode(self, e: Entry) -> JobRequest:
        payload = e.payload
        if payload is None:
            raise ProtocolError("entry has no 'data' field (expected the msgpack JobRequest)")
        return decode_job(payload)

    def _start_all(self, fresh: list[tuple[Entry, JobRequest]]) -> None:
        pipe = ScriptPipeline(self.client)
        owners, idx = [], []
        for e, req in fresh:
            owner = new_owner_value(self.worker_id)
            owners.append(owner)
            idx.append((self.fence.take_ownership(pipe, req.job_id, owner, self.ttl_ms),
                        pipe.command("EXISTS", self.keys.cancel(req.job_id)),
                        pipe.command("XRANGE", self.keys.results(req.job_id), "-", "+")))
        res = pipe.execute()
        for (e, req), owner, (i_own, i_cancel, i_range) in zip(fresh, owners, idx):
            job = Job(entry=e, request=req, owner=owner, worker_id=self.worker_id)
            bad = next((r for r in (res[i_own], res[i_cancel], res[i_range])
                        if isinstance(r, Exception)), None)
            if bad is not None:  # e.g. WRONGTYPE on a per-job key: this job only
                self._reject(e, ProtocolError(f"cannot use the job's keys: {bad}",
                                              code=ErrorCode.INTERNAL))
                continue
            self.jobs[req.job_id] = job
            self._start(job, progress_from_entries(res[i_range] or []), bool(res[i_cancel]))

    def _start(self, job: Job, progress: JobProgress, cancelled: bool) -> None:
        req = job.request
        if progress.finished:
            self.log.info("already finished; acknowledging", **job.log_fields())
            job.terminal = progress.terminal.type
            self._owe_ack(job, "already finished")
            return
        job.attempt = progress.attempts + 1
        if req.stream and progress.token_ids:
            job.next_seq = progress.next_seq
            job.out_ids, job.out_text = list(progress.token_ids), [progress.text]
            job.resumed_tokens = len(progress.token_ids)
        if cancelled:
            self._cancel(job, "cancel flag set before start")
            return
        if req.deadline_ms is not None and progress.attempts == 0 and now_ms() > req.deadline_ms:
            late = now_ms() - req.deadline_ms
            self._fail(job, ErrorCode.EXPIRED, f"deadline_ms={req.deadline_ms} passed {late} ms "
                       "before a worker could start the job; raise the deadline or add workers")
            return
        try:
            params = req.sampling_params()
        except ValidationError as exc:
            self._fail(job, ErrorCode.INVALID_REQUEST,
                       "invalid sampling params: " + _prefixed(describe_validation_error(exc)))
            return
        seed = progress.seed if progress.seed is not None else params.seed
        if seed is None:
            seed = random.SystemRandom().randrange(2**63)
        params.seed = job.seed = seed
        job.want_logprobs = params.logprobs is not None
        job.params = params
        if len(job.out_ids) >= params.max_tokens:  # taken over right after its last token
            job.finish(FinishReason.LENGTH.value, completion_tokens=len(job.out_ids))
            self.log.info("finished", finish_reason="length", tokens=len(job.out_ids),
                          **job.log_fields())
            return
        self._add_to_engine(job, resume=bool(job.out_ids))
        if job.terminal is None:
            job.queue_started()
            self.metrics.queue_time.observe(max(0.0, job.admitted_at - job.enqueued_ms / 1000))
            fields = job.log_fields()
            if self.s.log_prompts:
                fields["prompt"] = req.prompt or req.messages or req.prompt_token_ids
            self.log.info("started", attempt=job.attempt, resumed_tokens=job.resumed_tokens,
                          priority=req.priority, **fields)

    def _prompt(self, req: JobRequest) -> Any:
        if req.prompt is not None:
            return req.prompt
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        # As LLM.chat does: the rendered template already holds BOS and friends.
        text = self.engine.render_chat([m.model_dump() for m in req.messages])
        return list(self.engine.tokenizer.encode(text, add_special_tokens=False))

    def _add_to_engine(self, job: Job, resume: bool) -> None:
        """engine.add_request, mapping its refusals to error events; never raises."""
        try:
            state = resume_state(job.out_ids, job.text) if resume else None
            self.engine.add_request(job.job_id, self._prompt(job.request), job.params,
                                    priority=job.request.priority, resume=state)
            job.in_engine = True
        except PromptTooLongError as exc:
            self._fail(job, ErrorCode.PROMPT_TOO_LONG, str(exc))
        except (InvalidRequestError, ValueError, TypeError) as exc:
            self._fail(job, ErrorCode.INVALID_REQUEST, f"{type(exc).__name__}: {exc}")
        except Exception as exc:
            self.log.exception("engine refused the job unexpectedly", **job.log_fields())
            self._fail(job, ErrorCode.INTERNAL, f"engine error on add_request: {exc}")

    # ------------------------------------------------------------------ step
    def _step(self) -> None:
        """One engine step; events are queued for the flush that follows at once, while the
        step's logs and metrics wait until after it (``_account``): they are not on the path
        from the engine to the reader."""
        t0 = time.perf_counter()
        try:
            deltas = self.engine.step()
        except Exception as exc:
            self._engine_failed(exc)
            return
        self._engine_failures = 0
        ts = time.time()
        self.metrics.engine_step.observe(time.perf_counter() - t0)
        for d in deltas:
            job = self.jobs.get(d.request_id)
            if job is None or not job.in_engine:
                continue
            prev = job.last_token_at
            first = job.on_delta(d, ts)
            if d.finished:
                job.in_engine = False
            self._stepped.append((job, d, prev, first, ts))

    def _account(self) -> None:
        """Logs and metrics of the last step (after its flush)."""
        for job, d, prev, first, ts in self._stepped:
            if first:
                self.metrics.ttft.observe(max(0.0, ts - job.enqueued_ms / 1000))
                self.log.info("first_token", **job.log_fields())
            n = len(d.new_token_ids)
            if n:
                self.metrics.generation_tokens.inc(n)
                if prev is not None:
                    for _ in range(n):
                        self.metrics.itl.observe((ts - prev) / n)
            if d.finished:
                self._finished(job)
        self._stepped.clear()

    def _finished(self, job: Job) -> None:
        self.metrics.prompt_tokens.inc(job.prompt_tokens)
        self.metrics.e2e.observe(max(0.0, time.time() - job.enqueued_ms / 1000))
        self.metrics.finished.labels(job.finish_reason or "stop").inc()
        self.log.info("finished", finish_reason=job.finish_reason, tokens=len(job.out_ids),
                      **job.log_fields())

    def _engine_failed(self, exc: Exception) -> None:
        """A step raised. The engine may be unusable now (a CUDA error poisons the context), so
        the worker gives up on it: jobs the exception names (``request_ids``; every running job
        when it names none) are handed back counting a delivery, or dead-lettered (poison) when
        that was their last allowed one; the others are parked without counting one. The
        heartbeat reports the engine unloaded and the process exits 1 for its supervisor."""
        self._engine_failures += 1
        self.log.exception("engine step failed; handing jobs back and exiting")
        named = set(getattr(exc, "request_ids", None) or ())
        for job in [j for j in self.jobs.values() if j.in_engine]:
            try:
                self.engine.abort_request(job.job_id)
            except Exception:
                pass
            job.in_engine = False
            if named and job.job_id not in named:
                job.parking = True
            else:
                self._hand_back_suspect(job, exc)
        self._engine_broken = True
        self.exit_code = 1
        self.stop(force=True)

    def _hand_back_suspect(self, job: Job, exc: Exception) -> None:
        """Release a job that may have broken the engine. Each failure raises its delivery count
        (whoever takes it next counts one), so a prompt that kills every worker is dead-lettered
        after --max-deliveries instead of crash-looping the fleet."""
        e = job.entry
        self._drop(job, "engine failure: handed back counting a delivery", ack=False)
        if self.leases is None:
            return  # its lease expires and another worker reclaims it
        try:
            if e.deliveries >= self.s.max_deliveries:
                self.leases.dead_letter_entry(
                    e.lane_key, e.entry_id, e.fields, e.deliveries,
                    f"the engine failed on each of its {e.deliveries} deliveries "
                    f"({type(exc).__name__}: {exc})")
            else:
                self.leases.release([(e.lane_key, e.entry_id)])
        except REDIS_DOWN as err:
            self.log.warning("hand-back failed; the lease will expire instead", error=str(err),
                             **job.log_fields())

    # ------------------------------------------------------------------ terminal helpers
    def _fail(self, job: Job, code: ErrorCode, message: str) -> None:
        job.fail(code.value, message)
        self.metrics.errors.labels(code.value).inc()
        self.log.info("failed", code=code.value, error=message, **job.log_fields())

    def _cancel(self, job: Job, why: str) -> None:
        if job.in_engine:
            self.engine.abort_request(job.job_id)
            job.in_engine = False
        job.finish(FinishReason.CANCELLED.value)
        self.metrics.finished.labels("cancelled").inc()
        self.log.info("cancelled", why=why, tokens=len(job.out_ids), **job.log_fields())

    def _owe_ack(self, job: Job, reason: str) -> None:
        self.owed_acks.append(OwedAck(job.entry.lane_key, job.entry.entry_id, job.job_id, reason))

    def _drop(self, job: Job, why: str, ack: bool) -> None:
        """Stop working on a job we no longer own or can no longer report on."""
        if job.in_engine:
            self.engine.abort_request(job.job_id)
            job.in_engine = False
        job.pending.clear()
        self.jobs.pop(job.job_id, None)
        self.log.warning("dropped", why=why, **job.log_fields())
        if ack:
            self._owe_ack(job, why)

    def _reject(self, e: Entry, exc: ProtocolError) -> None:
        meta = _metadata_of(e.payload)
        self.rejections.append(Rejection(e, exc.job_id, exc.code.value, str(exc),
                                          new_owner_value(self.worker_id), meta))
        self.metrics.errors.labels(exc.code.value).inc()
        self.log.warning("failed", code=exc.code.value, error=str(exc), job_id=exc.job_id,
                         entry_id=e.entry_id, lane=e.lane, dead_letter=True)

    # ------------------------------------------------------------------ flush
    def _flush(self) -> None:
        """Ship everything owed in ONE pipeline; see the module docstring for the ordering."""
        pipe = ScriptPipeline(self.client)
        ack_groups: dict[str, list[OwedAck]] = defaultdict(list)
        for a in self.owed_acks:
            ack_groups[a.lane_key].append(a)
        acks = [(items, self.fence.ack(pipe, lane, [a.entry_id for a in items]))
                for lane, items in ack_groups.items()]
        step_jobs = [j for j in self.jobs.values() if j.pending or j.in_engine]
        writes = []
        now = time.monotonic()
        for k in range(0, len(step_jobs), STEP_WRITE_CHUNK):
            chunk = step_jobs[k:k + STEP_WRITE_CHUNK]
            refresh = [self._ttl_due(j, now) for j in chunk]
            writes.append((chunk, [len(j.pending) for j in chunk], refresh, self.fence.write_step(
                pipe, self.ttl_ms,
                [(j.job_id, j.owner, j.batch_id, list(j.pending), j.may_create, j.unsure, r)
                 for j, r in zip(chunk, refresh)])))
        rejects = [(r, self._queue_rejection(pipe, r)) for r in self.rejections]
        parks = self._queue_parks(pipe)
        if not len(pipe):
            return
        i_read = None
        if not self._stop.is_set() and self.engine.has_unfinished_requests():
            cap = self._capacity()  # ride the next iteration's read on this round trip
            if cap > 0:
                i_read = self.intake.read_new_into(pipe, cap)
        t0 = time.perf_counter()
        try:
            res = pipe.execute()
        except REDIS_DOWN:  # all state stays as is; the retry must check what already landed
            for job in step_jobs:
                job.unsure = bool(job.pending)
            raise
        self.metrics.step_redis.observe(time.perf_counter() - t0)
        if i_read is not None:
            self._prefetched = self.intake.new_entries(res[i_read])
        self.owed_acks = []
        for items, i in acks:
            self._on_acks(items, res[i])
        for chunk, counts, refresh, i in writes:
            batches = [j.batch_no for j in chunk]
            self._on_step_reply(chunk, counts, res[i])
            for job, r, before in zip(chunk, refresh, batches):
                if r and job.batch_no > before:     # written, so its TTLs were reset
                    job.ttl_set_at = now
        for rej, (i_write, i_dead) in rejects:
            self._on_rejection(rej, res, i_write, i_dead)
        for jobs, i in parks:
            self._on_park(jobs, res[i])

    def _ttl_due(self, job: Job, now: float) -> bool:
        """Whether this step's write should reset the job's TTLs: with a terminal event (the
        stream then lives result_ttl from its end) or once a tenth of the TTL has passed since
        the last reset (creation and checked retries always set them; see fencing)."""
        return bool(job.terminal) or now - job.ttl_set_at > self.ttl_ms / 10_000.0

    def _on_step_reply(self, jobs: list[Job], counts: list[int], reply: Any) -> None:
        if isinstance(reply, Exception):  # the whole call failed: every write is retried
            for job, n in zip(jobs, counts):
                if n:
                    self._on_write(job, n, WriteStatus.ERROR, str(reply))
            return
        for job, n, (status, cancel, text) in zip(jobs, counts, parse_step_reply(reply)):
            if n:
                self._on_write(job, n, status, text)
            if cancel and job.in_engine:
                self._cancel(job, "cancel flag")

    def _on_acks(self, items: list[OwedAck], reply: Any) -> None:
        if isinstance(reply, Exception):
            self.log.error("ack failed; will retry", error=str(reply))
            self.owed_acks.extend(items)
            return
        for a, code in zip(items, parse_ack_codes(reply)):
            job = self.jobs.get(a.job_id) if a.job_id else None
            if job is not None and job.entry.entry_id == a.entry_id:
                self.jobs.pop(a.job_id)
            if code is AckStatus.NOT_OWNER:
                self.log.warning("not acked: another worker holds the entry", job_id=a.job_id,
                                 entry_id=a.entry_id)
            else:
                self.log.info("acked", job_id=a.job_id, entry_id=a.entry_id, reason=a.reason,
                              was_pending=code is AckStatus.ACKED)

    def _on_write(self, job: Job, n: int, status: WriteStatus, detail: str) -> None:
        if status is WriteStatus.ERROR:
            job.write_failures += 1
            self.log.error("result write failed", error=detail, attempt=job.write_failures,
                           **job.log_fields())
            if job.write_failures >= MAX_WRITE_FAILURES:
                self._drop(job, f"result stream not writable: {detail}", ack=False)
                self._reject(job.entry, ProtocolError(
                    f"the worker could not write the job's result stream: {detail}",
                    code=ErrorCode.INTERNAL))
            return
        if status.written:
            del job.pending[:n]
            job.batch_no += 1
            job.may_create = False
            job.unsure = False
            job.write_failures = 0
            if job.terminal and not job.pending:
                self._owe_ack(job, job.terminal)
        elif status is WriteStatus.REFUSED:
            self._drop(job, "ownership lost: another worker took the job over", ack=False)
        else:  # missing/gone: the result stream expired, nobody can read this job any more
            self._drop(job, f"result stream {status.value}: the reader is gone", ack=True)

    def _queue_rejection(self, pipe: ScriptPipeline, r: Rejection) -> tuple[Optional[int], int]:
        i_write = None
        if r.job_id:
            self.fence.take_ownership_if_free(pipe, r.job_id, r.owner, self.ttl_ms)
            event = encode_event(ErrorEvent(code=r.code, message=r.message, metadata=r.metadata))
            i_write = self.fence.write_events(pipe, r.job_id, r.owner, self.ttl_ms,
                                              r.owner.rsplit(":", 1)[1], [event], True)
        dl = DeadLetter(data=r.entry.payload or b"", reason=r.message, code=r.code,
                        worker_id=self.worker_id, lane=r.entry.lane_key,
                        entry_id=r.entry.entry_id, job_id=r.job_id or "",
                        deliveries=r.entry.deliveries)
        return i_write, pipe.command("XADD", self.keys.dead, "*", *_flat(dl.to_fields()))

    def _on_rejection(self, r: Rejection, res: list, i_write: Optional[int], i_dead: int) -> None:
        if isinstance(res[i_dead], Exception):
            self.log.error("dead letter write failed; will retry", error=str(res[i_dead]),
                           entry_id=r.entry.entry_id)
            return
        self.rejections.remove(r)
        self.metrics.dead_letters.labels(r.code).inc()
        if i_write is not None and not isinstance(res[i_write], Exception) and \
                parse_write_status(res[i_write]) is WriteStatus.REFUSED:
            self.log.warning("error event not written: the job id belongs to another live job",
                             job_id=r.job_id, entry_id=r.entry.entry_id)
        self.owed_acks.append(OwedAck(r.entry.lane_key, r.entry.entry_id, r.job_id,
                                      "dead-lettered"))

    # ------------------------------------------------------------------ drain
    def _begin_drain(self) -> None:
        self._draining = True
        self._park_prefetched()
        timeout = 0.0 if self._force.is_set() else self.s.drain_timeout
        self._drain_deadline = time.monotonic() + timeout
        running = sum(1 for j in self.jobs.values() if j.in_engine)
        self.log.info("draining", running=running, drain_timeout_s=timeout)

    def _park_prefetched(self) -> None:
        """Entries read with the last flush but not admitted yet go back at once."""
        entries, self._prefetched = self._prefetched or [], None
        if not entries:
            return
        pipe = ScriptPipeline(self.client)
        by_lane: dict[str, list[str]] = defaultdict(list)
        for e in entries:
            by_lane[e.lane_key].append(e.entry_id)
        for lane, ids in by_lane.items():
            self.fence.park(pipe, lane, ids)
        try:
            pipe.execute()
            self.log.info("handed back unstarted entries", count=len(entries))
        except REDIS_DOWN as exc:  # they stay pending here; our restart or a reclaim takes them
            self.log.warning("could not hand back unstarted entries", error=str(exc))

    def _drain_step(self) -> bool:
        """While draining: True once nothing is held any more (exit)."""
        if self._force.is_set():
            self._drain_deadline = min(self._drain_deadline, time.monotonic())
        if time.monotonic() >= self._drain_deadline:
            for job in self.jobs.values():
                if job.in_engine:
                    self.engine.abort_request(job.job_id)
                    job.in_engine = False
                    job.parking = True
        if not self.jobs and not self.owed_acks and not self.rejections:
            return True
        if not self.engine.has_unfinished_requests() and not self._owes_writes():
            time.sleep(0.01)
        return False

    def _queue_parks(self, pipe: ScriptPipeline) -> list[tuple[list[Job], int]]:
        """Hand back parked jobs whose events are all written: release the owner record, move
        the entry to the parking consumer (idle time huge, delivery count unchanged)."""
        by_lane: dict[str, list[Job]] = defaultdict(list)
        for job in self.jobs.values():
            if job.parking and not job.pending:
                by_lane[job.entry.lane_key].append(job)
        out = []
        for lane, jobs in by_lane.items():
            for job in jobs:
                self.fence.release(pipe, job.job_id, job.owner)
            out.append((jobs, self.fence.park(pipe, lane, [j.entry.entry_id for j in jobs])))
        return out

    def _on_park(self, jobs: list[Job], reply: Any) -> None:
        if isinstance(reply, Exception):
            self.log.error("hand-back failed; entries stay pending here", error=str(reply))
        for job in jobs:
            self.jobs.pop(job.job_id, None)
            self.log.info("handed back", tokens=len(job.out_ids), **job.log_fields())


# ---------------------------------------------------------------------------------- helpers
def _flat(fields: dict) -> list:
    out: list = []
    for k, v in fields.items():
        out += [k, v]
    return out


def _prefixed(msg: str) -> str:
    return "; ".join(f"params.{p}" if not p.startswith("params") else p for p in msg.split("; "))


def _raw_map(payload: Optional[bytes]) -> dict:
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False) if payload else None
    except Exception:
        return {}
    return obj if isinstance(obj, dict) else {}


def _metadata_of(payload: Optional[bytes]) -> dict:
    meta = _raw_map(payload).get("metadata")
    return meta if isinstance(meta, dict) else {}


def _job_id_of(payload: Optional[bytes]) -> Optional[str]:
    from producer_sdk.protocol import validate_job_id
    jid = _raw_map(payload).get("job_id")
    try:
        return validate_job_id(jid)
    except ValueError:
        return None


def _entry_of(claimed: Any, intake: Intake) -> Entry:
    """Adapt F's ClaimedEntry (or an Entry) to an Entry."""
    if isinstance(claimed, Entry):
        return claimed
    lane_key = getattr(claimed, "lane_key", None) or getattr(claimed, "lane")
    entry_id = getattr(claimed, "entry_id", None) or getattr(claimed, "id")
    fields = getattr(claimed, "fields", None)
    if fields is None and getattr(claimed, "payload", None) is not None:
        fields = {b"data": claimed.payload}
    deliveries = int(getattr(claimed, "deliveries", 0) or getattr(claimed, "delivery_count", 0))
    return Entry(intake.lane_name(lane_key), lane_key, entry_id, fields, deliveries, "reclaimed")


def _safe_url(url: str) -> str:
    """The URL without its password, for logs."""
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"


def _pid() -> int:
    import os
    return os.getpid()
