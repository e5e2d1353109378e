"""Prefix affinity, worker side: this worker's own streams, and never stranding another's.

A producer sends a job with a routing key to one worker's affinity stream
(``Keys.affinity(worker_id, shard)``, producer_sdk/core/affinity.py), so the turns of a conversation
meet the KV blocks of the turns before them in that worker's prefix cache.

Reading. The worker creates the consumer group on its affinity stream of every shard (at ``0``,
MKSTREAM, with its lanes) and reads it *before* the shared lanes, within the same "read only
what you can start" count (``own_lanes`` heads the PendingList's lanes of a shard). Why first:
nobody else reads that stream while this worker lives, while any worker takes shared entries,
so reading it first is what keeps the routed jobs from waiting behind work others could do. A
routed job keeps its priority inside the engine (the engine schedules every job by its exact
priority), and the producer's backlog bound (``affinity_max_backlog``) keeps the stream short,
so it never holds much ahead of the shared lanes.

Never stranded. Every heartbeat interval the worker sweeps the streams of the queue's other workers
that are dead (heartbeat hash gone) or draining: one script per stream (``MOVE_UNREAD``,
protocol/scripts/affinity.py; all keys in the stream's shard slot) moves each entry nobody holds --
unread, or parked by a draining worker -- to the shared lane of its priority, rewrites the job's
dedupe record to name the new entry and deletes the old one; once the stream is empty it deletes
the stream, so a producer's enqueue that still names it falls back to the shared lane (the enqueue
script, protocol/scripts/enqueue.py). Entries read but not acknowledged there (a dead worker's
running jobs) are reclaimed like shared-lane entries, by XAUTOCLAIM past the lease (``reclaim``),
so they resume elsewhere with their delivery counted. A draining worker moves its own unread
entries back at once (``hand_back_own``) and, at exit, whatever it parked (``close``); it leaves
the registry only when its streams are empty, so a stream it could not empty is still found and
swept.
"""

from __future__ import annotations

from typing import Any, Optional

import redis

from tokenrelay.protocol.errors import ProtocolError
from tokenrelay.protocol.heartbeat import Heartbeat
from tokenrelay.protocol.keys import GROUP, Keys, PARKING_CONSUMER, PAYLOAD_FIELD
from tokenrelay.protocol.limits import Limits
from tokenrelay.protocol.scripts import MOVE_UNREAD, ScriptPipeline, run_script, text
from tokenrelay.protocol.wire import decode_job
from tokenrelay.worker.entries import Entry, entry_fields, is_nogroup, own_streams
from tokenrelay.worker.logs import RateLimitedLog
from tokenrelay.worker.pending import PendingList
from tokenrelay.worker.connection import RedisClient
from tokenrelay.worker.logs import Log

PAGE = 500          # entries per move script call (Lua's unpack limit is far above)


def _lane_index(priority: int) -> int:
    return Keys.LANES.index(Keys.lane_for_priority(priority)) + 1


def route_back(payload: Optional[bytes], limits: Limits) -> tuple[Optional[str], int]:
    """(job id, lane index 1-3) an unread entry moves to: the shared lane of its priority;
    the default lane when the payload is unreadable (the reader will reject it there)."""
    try:
        job = decode_job(payload, limits)
    except ProtocolError as exc:
        return exc.job_id, _lane_index(0)
    return job.job_id, _lane_index(job.priority)


class Affinity:
    """One worker's affinity streams and its sweeps of the others'."""

    def __init__(self, client: RedisClient, keys: Keys, worker_id: str, pending: PendingList,
                 limits: Limits, log: Log, log_limited: RateLimitedLog) -> None:
        self.client = client
        self.keys = keys                # with the queue's registered shard count
        self.worker_id = worker_id
        self.pending = pending
        self.limits = limits
        self.log = log
        self.log_limited = log_limited
        self.foreign: list[str] = []    # dead or draining workers' streams that still exist

    @property
    def own(self) -> list[str]:
        """This worker's affinity stream on every shard."""
        return own_streams(self.keys, self.worker_id)

    def _each(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Single-key commands over many slots, one round trip per node (ScriptPipeline over
        topology.send_packed); raw replies, error replies in place."""
        pipe = ScriptPipeline(self.client)
        for cmd in commands:
            pipe.command(*cmd)
        return pipe.execute()

    # ---------------------------------------------------------------- heartbeat
    def unread(self) -> int:
        """Entries unread in this worker's affinity streams: part of the backlog producers
        route by (the heartbeat's ``affinity_queued``, producer_sdk/core/affinity.py)."""
        own = self.own
        replies = self._each([c for key in own for c in (("XLEN", key), ("XPENDING", key, GROUP))])
        unread = 0
        for length, pending in zip(replies[0::2], replies[1::2]):
            # XPENDING's summary, raw: [count, smallest id, greatest id, consumers]
            if isinstance(length, int) and isinstance(pending, list) and pending:
                unread += max(0, length - int(pending[0] or 0))
        return unread

    # ---------------------------------------------------------------- sweeps
    def _gone_workers(self) -> list[str]:
        """The queue's other registered workers that are dead (no heartbeat) or draining."""
        ids = [text(x) for x in self.client.zrange(self.keys.workers, 0, -1)]
        others = [w for w in ids if w != self.worker_id]
        if not others:
            return []
        replies = self._each([("HGETALL", self.keys.heartbeat(wid)) for wid in others])
        # a key of the wrong type (an error reply): not gone
        return [wid for wid, flat in zip(others, replies)
                if not isinstance(flat, Exception)
                and (not flat or Heartbeat.decode(entry_fields(flat)).draining)]

    def sweep(self) -> int:
        """Move what nobody holds out of dead or draining workers' streams on every shard
        (deleting those left empty); remember the rest for ``reclaim``. Returns the entries
        moved."""
        streams = [self.keys.affinity(wid, s) for wid in self._gone_workers()
                   for s in range(self.keys.shards)]
        if not streams:
            self.foreign = []
            return 0
        found = self._each([("EXISTS", key) for key in streams])
        present = [k for k, n in zip(streams, found) if n == 1]
        moved, left = 0, []
        for key in present:
            try:
                n, gone = self.empty_out(key, delete=True)
            except redis.ResponseError as exc:   # e.g. WRONGTYPE: that key alone is skipped
                self.log_limited("warning", "cannot sweep an affinity stream", lane=key,
                                 error=str(exc))
                continue
            moved += n
            if not gone:
                left.append(key)
        self.foreign = left
        if moved:
            self.log.info("moved routed jobs of a dead or draining worker to the shared lanes",
                          count=moved, streams=len(present))
        return moved

    def empty_out(self, key: str, delete: bool) -> tuple[int, bool]:
        """Move every entry of one affinity stream that nobody holds to the shared lanes, a
        page at a time; with ``delete``, delete the stream once empty. (moved, whether the
        stream is gone)."""
        shard = self.keys.shard_of_stream(key)
        lanes = [self.keys.lane(n, shard) for n in Keys.LANES]
        moved, start = 0, "-"
        while True:
            rows = self.client.xrange(key, start, "+", count=PAGE)
            last_page = len(rows) < PAGE
            keys, args = [key, *lanes], [GROUP, PARKING_CONSUMER, int(delete and last_page)]
            for entry_id, fields in rows:
                job_id, lane = route_back(fields.get(PAYLOAD_FIELD), self.limits)
                keys.append(self.keys.dedupe(job_id, shard) if job_id else key)
                args += [text(entry_id), lane, int(job_id is not None)]
            n, gone = run_script(self.client, MOVE_UNREAD, keys, args)
            moved += int(n)
            if last_page:
                return moved, bool(gone)
            start = "(" + text(rows[-1][0])

    def reclaim(self, count: int, min_idle_ms: int) -> list[Entry]:
        """Entries of dead or draining workers' streams idle past the lease (their holder died
        with them): taken like shared-lane reclaims, one delivery counted."""
        out: list[Entry] = []
        for key in list(self.foreign):
            if len(out) >= count:
                break
            try:
                out += self.pending.reclaim(count - len(out), min_idle_ms, streams=[key])
            except redis.ResponseError as exc:
                if not is_nogroup(exc):
                    raise
                self.foreign.remove(key)    # emptied and deleted by another worker's sweep
        return out

    # ---------------------------------------------------------------- this worker's streams
    def hand_back_own(self) -> int:
        """Draining: move this worker's unread routed jobs back to the shared lanes now (it
        reads nothing more); the producers stop routing here at its next beat."""
        moved = sum(self.empty_out(key, delete=False)[0] for key in self.own)
        if moved:
            self.log.info("handed routed jobs back to the shared lanes", count=moved)
        return moved

    def close(self) -> bool:
        """At exit: move what is unread or parked in this worker's streams to the shared lanes
        and delete the streams left empty. True when all are gone (the worker may leave the
        registry); False when some still hold entries (they are swept once its beat expires)."""
        return all(self.empty_out(key, delete=True)[1] for key in self.own)
