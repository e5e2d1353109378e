"""A job's status as queue users expect it (BullMQ's ``getState``, Celery's ``AsyncResult.state``),
read from what Redis already holds; workers write nothing for it.

States: ``queued`` (in its lane, not yet taken, or handed back by a draining worker),
``stranded`` (in a job stream no worker of the queue reads: one of another shard layout than
the queue registered, see ``protocol.lanes``; ``message`` says which), ``running``
(held by a worker), ``done``, ``cancelled``, ``failed`` (an error event; ``expired`` when its
deadline passed before it started), ``expired`` also when the job is known but its results have
expired, and ``unknown``. The reads are I/O-free here, shared by ``Client.status`` and
``AsyncClient.status``: ``queue_snapshot`` adds one MULTI to a pipeline and ``fold_status`` turns
its replies into a ``JobStatus``; for a queued job ``queue_position_reads`` and
``position_range`` count the entries ahead of it. ``status_plan`` is one job's sequence of
round trips (``Step``s); ``read_statuses`` runs many of them in lockstep, as a plan of effects
(``producer_sdk.core.effects``) that either client runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generator, Literal, Optional, Sequence

from pydantic import BaseModel, ConfigDict

from tokenrelay.producer_sdk.core.affinity import is_affinity_stream
from tokenrelay.producer_sdk.core.effects import Call, Plan, cluster
from tokenrelay.producer_sdk.core.reads import fields_dict
from tokenrelay.protocol.errors import ProtocolError
from tokenrelay.protocol.events import ErrorEvent
from tokenrelay.protocol.keys import (EVENT_FIELD, GROUP, Keys, PARKING_CONSUMER, key_slot,
                                      parse_dedupe_record)
from tokenrelay.protocol.shards import SHARDS_FIELD, ShardCountMismatch, parse_shards
from tokenrelay.protocol.wire import decode_event

State = Literal["queued", "stranded", "running", "done", "cancelled", "failed", "expired",
                "unknown"]
POSITION_CAP = 1000     # entries counted ahead of a queued job in its own lane, at most
# Jobs whose reads share one round of pipelines: a round's snapshot is one MULTI (per slot), which
# Redis runs without serving anyone else, so it is bounded: 50,000 ids in one MULTI stalled
# Redis for every other client for ~100-230 ms; 128 jobs (640 cheap commands) take a few ms
# (benchmarks/statuses.py).
STATUS_CHUNK = 128


class JobStatus(BaseModel):
    """Where one job stands. ``position`` (queued only, approximate: workers read concurrently)
    counts the jobs ahead of it: not yet taken in more urgent lanes, and before it in its own
    lane (at most POSITION_CAP of those)."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    state: State
    lane: Optional[str] = None              # urgent | default | bulk | affinity (routed to a
                                            # worker by its routing key)
    position: Optional[int] = None
    worker_id: Optional[str] = None         # running: the worker holding it
    tokens: int = 0                         # output tokens written so far (several choices:
                                            # those of the choice written last; done: all)
    deliveries: int = 0                     # times a worker was given the entry
    finish_reason: Optional[str] = None     # done / cancelled
    error_code: Optional[str] = None        # failed / expired
    message: Optional[str] = None
    cancel_requested: bool = False

    @property
    def finished(self) -> bool:
        """Whether the job ended (done, cancelled, failed, or expired before it started):
        nothing is left to cancel. Records that expired are not an end the job reached."""
        return self.state in ("done", "cancelled", "failed") or (
            self.state == "expired" and self.error_code is not None)


@dataclass(frozen=True)
class Step:
    """One round trip of a plan: a pipeline (MULTI when ``transaction``) and what it queues;
    a MULTI's keys are all in the slot of ``slot_key`` (a cluster runs it on that slot's
    master, and refuses a MULTI across slots)."""

    transaction: bool
    queue: Callable[[Any], Any]
    slot_key: Optional[str] = None

    def pipeline(self, redis: Any) -> Any:
        pipe = redis.pipeline(transaction=self.transaction)
        self.queue(pipe)
        return pipe

    def execute(self, redis: Any) -> Any:
        """Send the step; its replies, errors as values (awaitable on an asyncio client)."""
        return self.pipeline(redis).execute(False)


# An I/O-free sequence of round trips: it yields Steps, is sent each one's replies (errors as
# values) and returns its answer; ``read_statuses`` drives many through Lockstep.
StepPlan = Generator[Step, Any, Any]


class _Counting:
    """A pipeline stand-in that counts the commands a step queues (its share of the replies)."""

    def __init__(self, pipe: Any) -> None:
        self.pipe, self.n = pipe, 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.pipe, name)

        def queued(*args: Any, **kwargs: Any) -> Any:
            self.n += 1
            return method(*args, **kwargs)
        return queued


class Lockstep:
    """Many plans at once: each round merges every live plan's next step into at most two
    pipelines (plain, MULTI), so N jobs' statuses cost the round trips of one; ``by_slot``
    (a Redis Cluster) makes one MULTI per slot instead (a queue shard's jobs share one).
    I/O-free: the driver executes ``round()``'s steps and ``feed``s their replies, in order."""

    def __init__(self, plans: list[StepPlan], by_slot: bool = False) -> None:
        self.plans = plans
        self.by_slot = by_slot
        self.results: list[Any] = [None] * len(plans)
        self._replies: dict[int, Any] = {i: None for i in range(len(plans))}
        self._shares: list[list[tuple[int, int]]] = []

    def round(self) -> Optional[list[Step]]:
        steps: dict[int, Step] = {}
        for i, reply in self._replies.items():
            try:
                steps[i] = self.plans[i].send(reply)
            except StopIteration as done:
                self.results[i] = done.value
        if not steps:
            return None
        merged, self._shares = [], []
        for (transaction, _), mine in self._batches(steps).items():
            shares: list[tuple[int, int]] = []
            merged.append(Step(transaction, lambda p, mine=mine, shares=shares:
                               _queue_all(p, mine, shares), mine[0][1].slot_key))
            self._shares.append(shares)
        return merged

    def _batches(self, steps: dict[int, Step]) -> dict[tuple[bool, Any], list[tuple[int, Step]]]:
        """Steps that go in one pipeline: every plain one together; MULTIs together, or by
        slot."""
        out: dict[tuple[bool, Any], list[tuple[int, Step]]] = {}
        for i, step in sorted(steps.items(), key=lambda kv: kv[1].transaction):
            slot = key_slot(step.slot_key) if (self.by_slot and step.transaction
                                               and step.slot_key) else None
            out.setdefault((step.transaction, slot), []).append((i, step))
        return out

    def feed(self, replies: list[list[Any]]) -> None:
        self._replies = {}
        for shares, reply in zip(self._shares, replies):
            at = 0
            for i, n in shares:
                self._replies[i] = reply[at:at + n]
                at += n


def read_statuses(targets: Sequence[tuple[Keys, str, Optional[int]]],
                  position: bool = True) -> Plan[list[JobStatus]]:
    """``status_plan`` of each (keys, job id, shard) target, STATUS_CHUNK targets at a time in
    the round trips of one: each Lockstep round's pipelines, one after another. On a Redis
    Cluster a MULTI per slot."""
    by_slot = yield cluster()
    out: list[JobStatus] = []
    for at in range(0, len(targets), STATUS_CHUNK):
        lock = Lockstep([status_plan(k, j, s, position)
                         for k, j, s in targets[at:at + STATUS_CHUNK]], by_slot=by_slot)
        while (steps := lock.round()) is not None:
            replies = []
            for step in steps:
                replies.append((yield Call(step.execute)))
            lock.feed(replies)
        out.extend(lock.results)
    return out


def _queue_all(pipe: Any, steps: list[tuple[int, Step]], shares: list) -> None:
    for i, step in steps:
        counting = _Counting(pipe)
        step.queue(counting)
        shares.append((i, counting.n))


def status_plan(keys: Keys, job_id: str, shard: Optional[int] = None,
                position: bool = True) -> StepPlan:
    """The reads of ``Client.status`` for a job of ``keys``' queue (on ``shard``, None: the
    one its id goes to): the dedupe record, one MULTI snapshot (all in the shard's slot), and
    (``position``) for a queued job the queue's registered shard count, the lanes' groups and
    the entries ahead of it in its lane. A job of a sharded queue not found there is looked
    for in the one-shard layout too (where producers that guessed the count put it): a job
    queued in a layout the queue did not register is ``stranded``."""
    shard = keys.shard_of(job_id) if shard is None else shard
    one = Keys(keys.namespace, keys.queue) if keys.shards > 1 else None
    found = yield Step(False, lambda p: [p.get(k.dedupe(job_id, s)) for k, s in
                                         ((keys, shard), (one, 0)) if k is not None])
    record = found[0]
    if record is None and one is not None and found[1] is not None:
        keys, shard, record = one, 0, found[1]
    replies = yield Step(True, lambda p: queue_snapshot(p, keys, job_id, record, shard),
                         keys.results(job_id, shard))
    status = fold_status(keys, job_id, record, replies, shard)
    if not position or status.state != "queued" or status.position is not None:
        return status
    registered, *reads = yield Step(False, lambda p: (p.hget(keys.config, SHARDS_FIELD),
                                                      queue_position_reads(p, keys)))
    stranded = stranded_status(status, keys, registered)
    if stranded is not None:
        return stranded
    ahead, span = position_range(keys, record, shard, reads)
    if span is not None:
        (entries,) = yield Step(False, lambda p: p.xrange(*span, count=POSITION_CAP))
        ahead += len(entries) if isinstance(entries, list) else 0
    return status.model_copy(update={"position": ahead})


def stranded_status(status: JobStatus, keys: Keys, registered: Any) -> Optional[JobStatus]:
    """``status`` as ``stranded`` when the queue registered another shard count than the
    layout the job's lane belongs to (no worker reads it), else None."""
    try:
        count = parse_shards(registered, keys.config)
    except ShardCountMismatch:
        return None
    if count is None or count == keys.shards:
        return None
    return status.model_copy(update={"state": "stranded", "message": (
        f"queued in a lane of the {keys.shards}-shard layout, but queue {keys.queue!r} is "
        f"registered with {count} shards: no worker reads it. Drain it by hand (python -m "
        f"worker admin unread lists such lanes) or resubmit the job")})


def liveness(status: JobStatus) -> str:
    """What reattaching needs of a status: 'active' (queued, running or results to read),
    'lost' (known, but its entry left the queue and its results expired before anyone read
    them) or 'unknown'. The snapshot is one MULTI, and workers write their first event before
    acknowledging, so an active job is never reported lost."""
    if status.state == "unknown":
        return "unknown"
    return "lost" if status.state == "expired" and status.error_code is None else "active"


def queue_snapshot(pipe: Any, keys: Keys, job_id: str, record: Any, shard: int) -> None:
    """Queue the reads of one job (5 replies) on a MULTI pipeline, after its dedupe record."""
    lane, entry = record_location(keys, record, shard)
    pipe.xrevrange(keys.results(job_id, shard), "+", "-", count=1)
    pipe.xrange(lane, entry, entry, count=1)
    pipe.xpending_range(lane, GROUP, min=entry, max=entry, count=1)
    pipe.get(keys.owner(job_id, shard))
    pipe.exists(keys.cancel(job_id, shard))


def lane_name(keys: Keys, lane_key: str) -> Optional[str]:
    """urgent/default/bulk of a lane key of any shard of ``keys``' queue (None: not one)."""
    try:
        shard = keys.shard_of_stream(lane_key)
    except KeyError:
        return None
    return next((n for n in Keys.LANES if keys.lane(n, shard) == lane_key), None)


def fold_status(keys: Keys, job_id: str, record: Any, replies: list[Any],
                shard: int = 0) -> JobStatus:
    last, in_lane, pending, owner, cancel = replies
    lane_key, _ = record_location(keys, record, shard)
    lane = (lane_name(keys, lane_key)
            or ("affinity" if is_affinity_stream(keys, lane_key) else None)) if record else None
    event = _last_event(last)
    base = dict(job_id=job_id, lane=lane, cancel_requested=cancel == 1, tokens=_tokens(event))
    if event is not None and event.type == "done":
        state = "cancelled" if event.finish_reason == "cancelled" else "done"
        return JobStatus(state=state, finish_reason=event.finish_reason, **base)
    if isinstance(event, ErrorEvent):
        state = "expired" if event.code == "expired" else "failed"
        return JobStatus(state=state, error_code=event.code, message=event.message, **base)
    row = pending[0] if isinstance(pending, list) and pending else None
    if row is not None:
        consumer, deliveries = pending_row(row)
        if consumer == PARKING_CONSUMER:    # handed back by a draining worker: taken first
            return JobStatus(state="queued", position=0, deliveries=deliveries, **base)
        worker = _text(owner).rsplit(":", 1)[0] if owner else consumer
        return JobStatus(state="running", worker_id=worker, deliveries=deliveries, **base)
    if isinstance(in_lane, list) and in_lane:
        return JobStatus(state="queued", **base)
    if event is not None:       # written to, no longer held: between a holder and its successor
        return JobStatus(state="running", **base)
    return JobStatus(state="expired" if record else "unknown", **base)


def queue_position_reads(pipe: Any, keys: Keys) -> None:
    """For every lane of every shard: XINFO GROUPS and XLEN (2 replies each, ``lanes()``
    order)."""
    for lane in keys.lanes():
        pipe.xinfo_groups(lane)
        pipe.xlen(lane)


def position_range(keys: Keys, record: Any, shard: int,
                   replies: list[Any]) -> tuple[int, Optional[tuple]]:
    """Jobs not yet taken in more urgent lanes (of every shard: workers read all of them), and
    the XRANGE (lane, after, up to) that counts the ones ahead in the job's own lane (None
    when its group has not read that lane yet). Approximate: workers read shard by shard,
    and another shard's jobs of the same lane are not counted."""
    lane_key, entry = record_location(keys, record, shard)
    if is_affinity_stream(keys, lane_key):
        # its worker reads that stream before any lane: what is ahead is what precedes it there
        # (some of it may be running already)
        return 0, (lane_key, "-", f"({entry}")
    rank = Keys.LANES.index(lane_name(keys, lane_key) or "default")
    ahead, span = 0, None
    for i, lane in enumerate(keys.lanes()):
        group = _group(replies[2 * i])
        if lane == lane_key:
            after = _text(group["last-delivered-id"]) if group else "0-0"
            span = (lane, f"({after}", f"({entry}")
        elif i % len(Keys.LANES) < rank:
            taken = int(group["pending"]) if group else 0
            ahead += max(0, int(replies[2 * i + 1] or 0) - taken)
    return ahead, span


def _group(reply: Any) -> Optional[dict]:
    if isinstance(reply, list):
        for g in reply:
            if _text(g.get("name")) == GROUP:
                return g
    return None


def pending_row(row: Any) -> tuple[str, int]:
    """(consumer, times delivered) of an XPENDING row: redis-py's dict, or the raw
    [id, consumer, idle, deliveries] a cluster MULTI returns (redis-py applies no callbacks
    there)."""
    if isinstance(row, dict):
        return _text(row["consumer"]), int(row["times_delivered"])
    return _text(row[1]), int(row[3])


def _last_event(reply: Any) -> Any:
    if not isinstance(reply, list) or not reply:
        return None
    try:
        return decode_event(fields_dict(reply[0][1])[EVENT_FIELD])
    except (ProtocolError, KeyError, IndexError, TypeError):
        return None


def _tokens(event: Any) -> int:
    if event is None:
        return 0
    if event.type == "token":
        return event.position + len(event.token_ids)
    if event.type == "started":
        return event.resumed_tokens
    usage = getattr(event, "usage", None)
    return usage.completion_tokens if usage is not None else 0


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def record_location(keys: Keys, record: Any, shard: int = 0) -> tuple[str, str]:
    """(lane key, entry id) a job's dedupe record names, for an XRANGE that finds nothing when
    there is no record (or it is unreadable): then the default lane of the job's ``shard``, so
    every read of one job stays in its shard's slot."""
    if record:
        try:
            return parse_dedupe_record(record)
        except ProtocolError:
            pass
    return keys.lane("default", shard), "0-0"
