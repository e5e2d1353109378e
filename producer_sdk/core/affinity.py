"""Prefix-affinity routing, producer side: jobs with the same routing key go to the same worker.

Why: a worker's engine keeps the KV blocks of prompts it served in its prefix cache, so turn 2 of
a conversation (whose prompt starts with all of turn 1) costs only its new tokens -- on the
worker that ran turn 1. Jobs from the shared lanes land on whichever worker reads first, so a
conversation's turns scatter over the fleet and each worker recomputes the history.

How: a job with ``routing_key`` (a conversation or system-prompt id; OpenAI's
``prompt_cache_key``) is enqueued on one worker's own stream, ``Keys.affinity(worker_id,
shard)`` (shard = ``Keys.shard_of(job_id)``, the slot of the job's dedupe record, so the one
enqueue script writes it), which only that worker reads, before its shared lanes
(worker/affinity.py). The worker is chosen by rendezvous (highest random weight) hashing of the
key over the queue's live workers: every producer picks the same one without coordination, and
when a worker leaves or joins only the keys it wins or held move.

Live workers come from their heartbeats (``Keys.workers`` registry, then each heartbeat hash), read
at most once per ``affinity_ttl_s`` per queue: a worker qualifies when its hash exists (a dead
worker's expires within 5 beats), it advertises ``affinity``, serves this queue with its engine
loaded and is not draining -- ``Heartbeat.serving``, what the model listing calls live, no
stricter: a worker whose loop is slow for a beat or two (a long prefill step) keeps its
conversations, while the few jobs routed to a worker that died before its hash expired are moved to
the shared lanes by the sweep. A job goes to the shared lane of its priority, as one without a key,
when no worker qualifies or the chosen one's backlog -- what it held and what sat unread in its
affinity streams at its last beat, plus what this router sent it since -- is at or past
``affinity_max_backlog``. Affinity never strands a job: the enqueue script itself falls back to the
shared lane when the chosen worker's stream no longer exists (its worker deleted it while draining,
or a sweep did after it died), and workers move what sits unread in a dead or draining worker's
stream back to the shared lanes (worker/affinity.py).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

from redis.exceptions import ClusterError, RedisClusterException, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tokenrelay.producer_sdk.core.effects import Plan, pipeline
from tokenrelay.producer_sdk.jobs.payloads import Prepared
from tokenrelay.protocol.heartbeat import FIELDS, Heartbeat
from tokenrelay.protocol.keys import Keys

# What a read of the heartbeats may raise while Redis or a cluster node is unreachable.
READ_ERRORS = (RedisConnectionError, RedisTimeoutError, ClusterError, RedisClusterException,
               TryAgainError)


def score(routing_key: str, worker_id: str) -> int:
    """The rendezvous weight of a worker for a key: 64 bits of a keyed hash, the same in every
    process (no PYTHONHASHSEED)."""
    digest = hashlib.blake2b(f"{routing_key}\x00{worker_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank(routing_key: str, worker_ids: Iterable[str]) -> list[str]:
    """Workers by descending weight for ``routing_key`` (ties, never seen in 64 bits, by id)."""
    return sorted(worker_ids, key=lambda w: (-score(routing_key, w), w))


@dataclass(frozen=True)
class LiveWorker:
    """A worker that takes affinity jobs, as its last heartbeat described it."""

    worker_id: str
    backlog: int        # jobs held + unread in its affinity streams, at its last beat


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def live_worker(queue: str, worker_id: str, beat: Optional[Heartbeat]) -> Optional[LiveWorker]:
    """The worker if its heartbeat (None: the hash is gone) says it takes affinity jobs of
    ``queue``, else None."""
    if beat is None or not beat.affinity or not beat.serving(queue):
        return None
    return LiveWorker(worker_id, max(0, beat.held) + max(0, beat.affinity_queued))


def live_workers_plan(keys: Keys) -> Plan[dict[str, LiveWorker]]:
    """The queue's workers that take affinity jobs now: the registry, then every heartbeat's
    fields (two round trips)."""
    (ids,) = yield pipeline([("ZRANGE", keys.workers, 0, -1)])
    workers = sorted({_text(w) for w in ids or ()} - {""})
    if not workers:
        return {}
    rows = yield pipeline([("HMGET", keys.heartbeat(w), *FIELDS) for w in workers])
    found = (live_worker(keys.queue, w, Heartbeat.from_row(row)) for w, row in zip(workers, rows))
    return {lw.worker_id: lw for lw in found if lw is not None}


@dataclass
class _Snapshot:
    workers: dict[str, LiveWorker]
    expires: float
    sent: dict[str, int] = field(default_factory=dict)   # routed here since the read


class AffinityRouter:
    """Decides, per job with a routing key, the worker whose affinity stream it goes to
    (``Prepared.affinity``; None: the shared lanes). One per client; the I/O is the caller's
    (``route_plan``, run by either client) and happens only for a queue whose snapshot is older
    than ``ttl_s`` when a keyed job is sent to it."""

    def __init__(self, keys: Keys, ttl_s: float, max_backlog: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.keys = keys
        self.ttl_s = ttl_s
        self.max_backlog = max_backlog
        self.clock = clock
        self._snapshots: dict[str, _Snapshot] = {}

    def _keys(self, queue: Optional[str]) -> Keys:
        return self.keys if queue is None or queue == self.keys.queue else \
            self.keys.with_queue(queue)

    def stale(self, jobs: Sequence[Prepared]) -> list[str]:
        """Queues of keyed jobs whose snapshot must be (re)read before ``assign``."""
        now = self.clock()
        queues = {self._keys(j.queue).queue for j in jobs if j.routing_key is not None}
        return sorted(q for q in queues
                      if q not in self._snapshots or self._snapshots[q].expires <= now)

    def store(self, queue: str, workers: dict[str, LiveWorker]) -> None:
        self._snapshots[queue] = _Snapshot(workers, self.clock() + self.ttl_s)

    def invalidate(self) -> None:
        self._snapshots.clear()

    def choose(self, queue: str, routing_key: str) -> Optional[str]:
        """The worker for one job, counting it into that worker's backlog; None: the shared
        lanes (no live worker, or the chosen one is at its bound)."""
        snap = self._snapshots.get(queue)
        if snap is None or not snap.workers:
            return None
        best = rank(routing_key, snap.workers)[0]
        if snap.workers[best].backlog + snap.sent.get(best, 0) >= self.max_backlog:
            return None
        snap.sent[best] = snap.sent.get(best, 0) + 1
        return best

    def assign(self, jobs: Sequence[Prepared]) -> None:
        """Set ``affinity`` of every job (None for a job without a routing key)."""
        for j in jobs:
            j.affinity = None if j.routing_key is None else self.choose(
                self._keys(j.queue).queue, j.routing_key)

    def route_plan(self, jobs: Sequence[Prepared]) -> Plan[None]:
        """Refresh what is stale, then ``assign`` the keyed jobs (the others are left alone: no
        work for the bulk path). A read that fails (a lost connection, a cluster failing a
        master over) keeps the last view, or sends the jobs to the shared lanes when there is
        none: routing never fails a submit, whose own retries ride out the failover."""
        keyed = [j for j in jobs if j.routing_key is not None]
        for queue in self.stale(keyed):
            try:
                self.store(queue, (yield from live_workers_plan(self._keys(queue))))
            except READ_ERRORS:
                pass
        self.assign(keyed)


def is_affinity_stream(keys: Keys, key: str) -> bool:
    """Whether ``key`` is some worker's affinity stream of this queue (not a shared lane)."""
    if key in keys.lanes():
        return False
    try:
        keys.shard_of_stream(key)
    except KeyError:
        return False
    return True


def affinity_target(keys: Keys, job: Prepared, shard: int) -> Optional[str]:
    """The affinity stream a routed job is enqueued on (None: a shared lane): the worker's
    stream on the job's shard (``Keys.shard_of(job_id)``, the slot of its dedupe record)."""
    if job.affinity is None:
        return None
    return keys.affinity(job.affinity, shard)


__all__ = ["score", "rank", "LiveWorker", "live_worker", "live_workers_plan", "AffinityRouter",
           "affinity_target", "is_affinity_stream"]
