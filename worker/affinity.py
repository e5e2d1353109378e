"""Prefix affinity, worker side: this worker's own streams, and never stranding another's.

A producer sends a job with a routing key to one worker's affinity stream
(``Keys.affinity(worker_id, shard)``, producer_sdk/affinity.py), so the turns of a conversation
meet the KV blocks of the turns before them in that worker's prefix cache.

Reading. The worker creates the consumer group on its affinity stream of every shard (at ``0``,
MKSTREAM, with its lanes) and reads it *before* the shared lanes, within the same "read only
what you can start" count (``own_lanes`` heads the PendingList's lanes of a shard). Why first:
nobody else reads that stream while this worker lives, while any worker takes shared entries,
so reading it first is what keeps the routed jobs from waiting behind work others could do. A
routed job keeps its priority inside the engine (the engine schedules every job by its exact
priority), and the producer's backlog bound (``affinity_max_backlog``) keeps the stream short,
so it never holds much ahead of the shared lanes.

Never stranded. Every heartbeat interval the worker sweeps the streams of the queue's other
workers that are dead (heartbeat hash gone) or draining: one script per stream (``MOVE_UNREAD``,
all keys in the stream's shard slot) moves each entry nobody holds -- unread, or parked by a
draining worker -- to the shared lane of its priority, rewrites the job's dedupe record to name
the new entry and deletes the old one; once the stream is empty it deletes the stream, so a
producer's enqueue that still names it falls back to the shared lane (producer_sdk/_wire.py).
Entries read but not acknowledged there (a dead worker's running jobs) are reclaimed like
shared-lane entries, by XAUTOCLAIM past the lease (``reclaim``), so they resume elsewhere with
their delivery counted. A draining worker moves its own unread entries back at once
(``hand_back_own``) and, at exit, whatever it parked (``close``); it leaves the registry only
when its streams are empty, so a stream it could not empty is still found and swept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import redis

from protocol.errors import ProtocolError
from protocol.keys import GROUP, Keys, PARKING_CONSUMER
from protocol.limits import Limits
from protocol.wire import decode_job
from worker.scripts import ScriptPipeline, _lua, run_script, text

if TYPE_CHECKING:   # worker.pending imports this module (its lanes start with own_lanes)
    from worker.pending import Entry

PAGE = 500          # entries per move script call (Lua's unpack limit is far above)

AFFINITY_LANE = "affinity"      # the lane name of entries read from an affinity stream

# KEYS: the affinity stream, the urgent, default and bulk lanes of its shard, then one key per
# entry: the job's dedupe record (the stream key again when the job id is unreadable).
# ARGV: group, parking consumer, delete-when-empty (1/0), then per entry: id, lane index (1-3),
# has-dedupe (1/0). Each entry still in the stream and pending at nobody (unread) or at the
# parking consumer is added to its lane with the same fields; the dedupe record, when it names
# this entry, is rewritten to name the new one (KEEPTTL); the old entry is acknowledged (if
# parked) and deleted. Entries a consumer holds are left to the lease. A stream left empty is
# deleted when asked, so producers' enqueues that name it fall back to the shared lane.
# Returns {moved, gone (1: the stream no longer exists)}.
MOVE_UNREAD = _lua("move_unread", """
local s, group, parked = KEYS[1], ARGV[1], ARGV[2]
if redis.call('EXISTS', s) == 0 then return {0, 1} end
local moved, k = 0, 0
for i = 4, #ARGV, 3 do
  k = k + 1
  local id = ARGV[i]
  local e = redis.call('XRANGE', s, id, id)
  if #e == 1 then
    local holder = false
    local p = redis.pcall('XPENDING', s, group, id, id, 1)
    if type(p) == 'table' and not p.err and #p == 1 then holder = p[1][2] end
    if not holder or holder == parked then
      local lane = KEYS[1 + tonumber(ARGV[i + 1])]
      local new = redis.call('XADD', lane, '*', unpack(e[1][2]))
      if ARGV[i + 2] == '1' and redis.call('GET', KEYS[4 + k]) == s .. '$sep' .. id then
        redis.call('SET', KEYS[4 + k], lane .. '$sep' .. new, 'KEEPTTL')
      end
      if holder then redis.call('XACK', s, group, id) end
      redis.call('XDEL', s, id)
      moved = moved + 1
    end
  end
end
if ARGV[3] == '1' and redis.call('XLEN', s) == 0 then
  redis.call('DEL', s)
  return {moved, 1}
end
return {moved, 0}
""")


def own_lanes(keys: Keys, worker_id: str, shard: int) -> list[tuple[str, str]]:
    """(lane name, key) of this worker's affinity stream on ``shard``: read before the shard's
    shared lanes."""
    return [(AFFINITY_LANE, keys.affinity(worker_id, shard))]


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

    def __init__(self, worker: Any) -> None:
        self.w = worker
        self.foreign: list[str] = []    # dead or draining workers' streams that still exist

    @property
    def keys(self) -> Keys:
        """The worker's keys: read each time, as the worker replaces them once it knows the
        queue's registered shard count."""
        return self.w.keys

    @property
    def own(self) -> list[str]:
        """This worker's affinity stream on every shard."""
        return [key for s in range(self.keys.shards)
                for _, key in own_lanes(self.keys, self.w.worker_id, s)]

    def _each(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Single-key commands over many slots, one round trip per node (ScriptPipeline over
        topology.send_packed); raw replies, error replies in place."""
        pipe = ScriptPipeline(self.w.client)
        for cmd in commands:
            pipe.command(*cmd)
        return pipe.execute()

    # ---------------------------------------------------------------- heartbeat
    def heartbeat_fields(self) -> dict[str, Any]:
        """What producers route by (producer_sdk/affinity.py): that this worker reads affinity
        streams, and its unread affinity entries (part of its backlog)."""
        own = self.own
        replies = self._each([c for key in own for c in (("XLEN", key), ("XPENDING", key, GROUP))])
        unread = 0
        for length, pending in zip(replies[0::2], replies[1::2]):
            # XPENDING's summary, raw: [count, smallest id, greatest id, consumers]
            if isinstance(length, int) and isinstance(pending, list) and pending:
                unread += max(0, length - int(pending[0] or 0))
        return {"affinity": 1, "affinity_queued": unread}

    # ---------------------------------------------------------------- sweeps
    def _gone_workers(self) -> list[str]:
        """The queue's other registered workers that are dead (no heartbeat) or draining."""
        ids = [text(x) for x in self.w.client.zrange(self.keys.workers, 0, -1)]
        others = [w for w in ids if w != self.w.worker_id]
        if not others:
            return []
        replies = self._each([c for wid in others for c in (
            ("HGET", self.keys.heartbeat(wid), "draining"), ("EXISTS", self.keys.heartbeat(wid)))])
        # a key of the wrong type (an error reply): not gone
        return [wid for wid, draining, alive in zip(others, replies[0::2], replies[1::2])
                if not isinstance(draining, Exception)
                and (alive == 0 or text(draining or b"0") == "1")]

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
                self.w.log_limited("warning", "cannot sweep an affinity stream", lane=key,
                                   error=str(exc))
                continue
            moved += n
            if not gone:
                left.append(key)
        self.foreign = left
        if moved:
            self.w.log.info("moved routed jobs of a dead or draining worker to the shared lanes",
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
            rows = self.w.client.xrange(key, start, "+", count=PAGE)
            last_page = len(rows) < PAGE
            keys, args = [key, *lanes], [GROUP, PARKING_CONSUMER, int(delete and last_page)]
            for entry_id, fields in rows:
                job_id, lane = route_back(fields.get(b"data"), self.w.limits)
                keys.append(self.keys.dedupe(job_id, shard) if job_id else key)
                args += [text(entry_id), lane, int(job_id is not None)]
            n, gone = run_script(self.w.client, MOVE_UNREAD, keys, args)
            moved += int(n)
            if last_page:
                return moved, bool(gone)
            start = "(" + text(rows[-1][0])

    def reclaim(self, count: int, min_idle_ms: int) -> list[Entry]:
        """Entries of dead or draining workers' streams idle past the lease (their holder died
        with them): taken like shared-lane reclaims, one delivery counted."""
        from worker.pending import is_nogroup   # not at the top: pending imports this module
        out: list[Entry] = []
        for key in list(self.foreign):
            if len(out) >= count:
                break
            try:
                out += self.w.pending.reclaim(count - len(out), min_idle_ms, streams=[key])
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
            self.w.log.info("handed routed jobs back to the shared lanes", count=moved)
        return moved

    def close(self) -> bool:
        """At exit: move what is unread or parked in this worker's streams to the shared lanes
        and delete the streams left empty. True when all are gone (the worker may leave the
        registry); False when some still hold entries (they are swept once its beat expires)."""
        return all(self.empty_out(key, delete=True)[1] for key in self.own)
