"""Fencing: every result write and every ack checks, atomically inside Redis, that this worker still
owns the job.

Why: XACK takes no consumer and XADD takes no owner, so a worker that was paused (GC, SIGSTOP,
a long step) after its job was reclaimed would otherwise write into the new owner's result stream
and ack the new owner's entry away. Two records decide ownership:

* ``Keys.owner(job_id)`` holds ``<worker_id>:<token>``; a worker sets it (fresh token) when it
  starts a job it holds in the group. The result stream shares its hash slot, so one Lua script
  checks the owner and appends events (``WRITE_EVENTS``).
* The consumer group's pending list names the consumer holding an entry; ``ACK`` checks it with
  XPENDING before XACK + XDEL (acknowledged entries are deleted: the stream is never trimmed).

Scripts are sent as EVALSHA inside ordinary pipelines; a NOSCRIPT reply (Redis restarted) is
retried with EVAL for that command only, so a step costs one round trip, not a SCRIPT EXISTS
round trip more as redis-py's pipelined ``Script`` objects do.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional, Sequence

import msgpack
import redis

from producer_sdk.protocol import BATCH_FIELD, GROUP, PARKED_IDLE_MS, PARKING_CONSUMER, Keys


@dataclass(frozen=True)
class LuaScript:
    name: str
    source: str

    @property
    def sha(self) -> str:
        return hashlib.sha1(self.source.encode()).hexdigest()


# The fenced append, shared by both write scripts; ``cur`` is the owner record's value as read by
# the caller (false when absent). Each event entry gets field b = "<batch id>:<k>" (k = 1..n).
# When ``check`` is 1 (a retry after a reply was lost) the last entry's b tells how much of this
# batch already landed, and only the rest is written. After the first write (create = 0) XADD
# runs with NOMKSTREAM: an expired stream is never recreated. The TTLs of the result stream and
# the owner record are (re)set when the stream is created, on a checked retry and when
# ``refresh`` is 1 (the worker asks for that when a TTL is due or the batch is terminal), not on
# every step: two PEXPIREs per job per step were a third of the step script's time.
# Returns ok | dup (whole batch already there) | refused (another owner) | missing (no owner
# record: it expired) | gone (result stream expired). Redis errors (a key of the wrong type,
# OOM) propagate to the caller's pcall.
_WRITE_FN = """
local function append(cur, ko, kr, owner, ttl, create, batch, events, check, refresh)
  if not cur then return 'missing' end
  if cur ~= owner then return 'refused' end
  local n = #events
  local done = 0
  if check == 1 then
    local last = redis.call('XREVRANGE', kr, '+', '-', 'COUNT', 1)
    if #last > 0 then
      local f = last[1][2]
      local prefix = batch .. ':'
      for i = 1, #f, 2 do
        if f[i] == 'b' and string.sub(f[i + 1], 1, #prefix) == prefix then
          done = tonumber(string.sub(f[i + 1], #prefix + 1)) or 0
        end
      end
    end
  end
  for k = done + 1, n do
    local id
    if create == 1 then
      id = redis.call('XADD', kr, '*', 'data', events[k], 'b', batch .. ':' .. k)
    else
      id = redis.call('XADD', kr, 'NOMKSTREAM', '*', 'data', events[k], 'b', batch .. ':' .. k)
    end
    if not id then return 'gone' end
  end
  if create == 1 or check == 1 or refresh == 1 then
    redis.call('PEXPIRE', kr, ttl)
    redis.call('PEXPIRE', ko, ttl)
  end
  if done >= n then return 'dup' end
  return 'ok'
end

local function write(ko, kr, owner, ttl, create, batch, events, check)
  return append(redis.call('GET', ko), ko, kr, owner, ttl, create, batch, events, check, 1)
end
"""

# KEYS: owner, results. ARGV: owner value, ttl ms, create ("1"/"0"), batch id, events...
# (always checks for an earlier partial attempt: used on the rare paths only)
WRITE_EVENTS = LuaScript("write_events", _WRITE_FN + """
local events = {}
for i = 5, #ARGV do events[#events + 1] = ARGV[i] end
local ok, res = pcall(write, KEYS[1], KEYS[2], ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4],
                      events, 1)
if ok then return res end
return 'error: ' .. tostring(res)
""")

# One call for every job of an engine step: the per-step Redis work is one round trip, one
# command and a handful of arguments. KEYS: per job owner, results, cancel. ARGV[1]: ttl ms;
# ARGV[2]: msgpack array, per job [owner value, create 0/1, batch id, check 0/1, [events],
# refresh 0/1]. Owners and cancel flags are read with one MGET each (a per-job GET and EXISTS
# cost more in script overhead than in Redis). Returns {status letters, cancel flags ('0'/'1'
# per job), {job number, error, ...}} with one letter per job: o ok, d dup, r refused,
# m missing, g gone, s skip (no events), e error. Each job is isolated (pcall): one job's broken
# key never fails another job's write (MGET reads a key of the wrong type as absent).
WRITE_STEP = LuaScript("write_step", _WRITE_FN + """
local jobs = cmsgpack.unpack(ARGV[2])
local status, cancel, errors = {}, {}, {}
local owner_keys, cancel_keys = {}, {}
for j = 1, #jobs do
  owner_keys[j] = KEYS[3 * j - 2]
  cancel_keys[j] = KEYS[3 * j]
end
if #jobs == 0 then return {'', '', errors} end
local owners = redis.call('MGET', unpack(owner_keys))
local flags = redis.call('MGET', unpack(cancel_keys))
for j = 1, #jobs do
  local job = jobs[j]
  local st = 's'
  if #job[5] > 0 then
    local ok, res = pcall(append, owners[j], KEYS[3 * j - 2], KEYS[3 * j - 1], job[1],
                          ARGV[1], job[2], job[3], job[5], job[4], job[6])
    if ok then
      st = string.sub(res, 1, 1)
    else
      st = 'e'
      errors[#errors + 1] = j
      errors[#errors + 1] = tostring(res)
    end
  end
  status[j] = st
  if flags[j] then cancel[j] = '1' else cancel[j] = '0' end
end
return {table.concat(status), table.concat(cancel), errors}
""")

# KEYS: lane. ARGV: group, consumer, ids... Returns one code per id:
# 1 acked+deleted, 0 not pending (already acked / never delivered), -1 pending at another consumer.
ACK = LuaScript("ack", """
local out = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 0 then
    out[#out + 1] = 0
  elseif p[1][2] ~= ARGV[2] then
    out[#out + 1] = -1
  else
    redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
    redis.call('XDEL', KEYS[1], ARGV[i])
    out[#out + 1] = 1
  end
end
return out
""")

# KEYS: lane. ARGV: group, consumer, parking consumer, idle ms, ids... Moves entries this consumer
# holds to the parking consumer with a huge idle time and no delivery-count change (JUSTID).
PARK = LuaScript("park", """
local n = 0
for i = 5, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p > 0 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, ARGV[i], 'IDLE', ARGV[4], 'JUSTID')
    n = n + 1
  end
end
return n
""")

# KEYS: lane. ARGV: group, consumer, parking consumer, count. Takes up to count parked entries
# (JUSTID: a hand-back is not a failed delivery) and returns {id, fields|false, deliveries}.
CLAIM_PARKED = LuaScript("claim_parked", """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', tonumber(ARGV[4]), ARGV[3])
local out = {}
for _, e in ipairs(p) do
  redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, e[1], 'JUSTID')
  local r = redis.call('XRANGE', KEYS[1], e[1], e[1])
  local fields = false
  if #r > 0 then fields = r[1][2] end
  out[#out + 1] = {e[1], fields, e[4]}
end
return out
""")

# KEYS: the lanes, most urgent first. ARGV: group, consumer, count. New entries (XREADGROUP >)
# up to count in all, urgent lane first, in one round trip: {lane index, id, fields}.
READ_NEW = LuaScript("read_new", """
local out = {}
local want = tonumber(ARGV[3])
for i = 1, #KEYS do
  if want <= 0 then break end
  local r = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', want, 'STREAMS',
                       KEYS[i], '>')
  if r and r[1] then
    for _, e in ipairs(r[1][2]) do
      out[#out + 1] = {i, e[1], e[2]}
      want = want - 1
    end
  end
end
return out
""")

# KEYS: lane. ARGV: group, consumer, start id, count. This consumer's pending entries after
# start id (XREADGROUP ... <id>), as {id, fields|false (deleted), deliveries}. In Lua so that the
# nil body of a deleted entry survives client-side parsing.
READ_OWN_PENDING = LuaScript("read_own_pending", """
local r = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', tonumber(ARGV[4]),
                     'STREAMS', KEYS[1], ARGV[3])
local out = {}
if not r or not r[1] then return out end
for _, e in ipairs(r[1][2]) do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], e[1], e[1], 1)
  local d = 0
  if #p > 0 then d = p[1][4] end
  out[#out + 1] = {e[1], e[2] or false, d}
end
return out
""")

# KEYS: lane. ARGV: group, consumer, ids... Resets the idle time of entries this consumer still
# holds (XCLAIM to itself, JUSTID: no delivery counted); never takes an entry someone reclaimed.
RENEW = LuaScript("renew", """
local n = 0
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p > 0 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    n = n + 1
  end
end
return n
""")

# KEYS: owner. ARGV: owner value. Deletes the owner record only if it is still ours.
RELEASE_OWNER = LuaScript("release_owner", """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
""")

ALL_SCRIPTS = (WRITE_EVENTS, WRITE_STEP, READ_NEW, ACK, PARK, CLAIM_PARKED, READ_OWN_PENDING, RENEW, RELEASE_OWNER)


class WriteStatus(str, Enum):
    OK = "ok"
    DUP = "dup"
    REFUSED = "refused"
    MISSING = "missing"
    GONE = "gone"
    SKIP = "skip"
    ERROR = "error"

    @property
    def written(self) -> bool:
        return self in (WriteStatus.OK, WriteStatus.DUP)


class AckStatus(int, Enum):
    ACKED = 1
    NOT_PENDING = 0
    NOT_OWNER = -1


def new_owner_value(worker_id: str) -> str:
    """A fresh ``<worker_id>:<token>``: the token tells apart two lives of the same worker id."""
    return f"{worker_id}:{secrets.token_hex(8)}"


def _text(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v


class ScriptPipeline:
    """A non-transactional pipeline whose script calls survive a script-cache flush.

    ``execute`` returns one result per command, exceptions in place (never raised) except
    connection errors, which propagate: the caller reconnects and retries the whole batch, which
    is safe because every write here is idempotent (batch ids, XPENDING-checked acks).
    """

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._cmds: list[tuple[Optional[LuaScript], tuple[Any, ...]]] = []

    def __len__(self) -> int:
        return len(self._cmds)

    def command(self, *args: Any) -> int:
        self._cmds.append((None, args))
        return len(self._cmds) - 1

    def script(self, script: LuaScript, keys: Sequence[Any], args: Sequence[Any]) -> int:
        self._cmds.append((script, (len(keys), *keys, *args)))
        return len(self._cmds) - 1

    def execute(self) -> list[Any]:
        if not self._cmds:
            return []
        if all(script is not None for script, _ in self._cmds):
            results = self._execute_scripts()
        else:
            pipe = self._client.pipeline(transaction=False)
            for script, args in self._cmds:
                if script is None:
                    pipe.execute_command(*args)
                else:
                    pipe.execute_command("EVALSHA", script.sha, *args)
            results = pipe.execute(raise_on_error=False)
        missing = [i for i, r in enumerate(results) if isinstance(r, redis.exceptions.NoScriptError)]
        if missing:
            retry = self._client.pipeline(transaction=False)
            for i in missing:
                script, args = self._cmds[i]
                retry.execute_command("EVAL", script.source, *args)
            for i, r in zip(missing, retry.execute(raise_on_error=False)):
                results[i] = r
        return results

    def _execute_scripts(self) -> list[Any]:
        """The per-step path (only EVALSHA, whose replies redis-py leaves raw anyway): packed
        and read on one pooled connection, without redis-py's per-command pipeline machinery,
        which cost more than Redis's own work for a step (~0.2 ms of client overhead). Error
        replies come back in place; connection errors propagate after dropping the connection."""
        pool = self._client.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command(conn.pack_commands(
                [("EVALSHA", script.sha, *args) for script, args in self._cmds]))
            results: list[Any] = []
            for _ in self._cmds:
                try:
                    results.append(conn.read_response())
                except redis.exceptions.ResponseError as exc:
                    results.append(exc)
            return results
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)


class Fence:
    """Builds the fenced commands of one worker into a ScriptPipeline."""

    def __init__(self, keys: Keys, worker_id: str, group: str = GROUP) -> None:
        self.keys = keys
        self.worker_id = worker_id
        self.group = group

    def take_ownership(self, pipe: ScriptPipeline, job_id: str, owner: str, ttl_ms: int) -> int:
        """Make ``owner`` the job's owner. Call only for an entry this consumer holds; from the
        moment it runs, every write of a previous owner is refused."""
        return pipe.command("SET", self.keys.owner(job_id), owner, "PX", int(ttl_ms))

    def write_events(self, pipe: ScriptPipeline, job_id: str, owner: str, ttl_ms: int,
                     batch_id: str, events: Sequence[bytes], create: bool) -> int:
        return pipe.script(WRITE_EVENTS, [self.keys.owner(job_id), self.keys.results(job_id)],
                           [owner, int(ttl_ms), "1" if create else "0", batch_id, *events])

    def take_ownership_if_free(self, pipe: ScriptPipeline, job_id: str, owner: str,
                               ttl_ms: int) -> int:
        """SET NX: used to report a bad entry's error without stealing a live job's stream."""
        return pipe.command("SET", self.keys.owner(job_id), owner, "PX", int(ttl_ms), "NX")

    def renew(self, pipe: ScriptPipeline, lane_key: str, entry_ids: Sequence[str]) -> int:
        return pipe.script(RENEW, [lane_key], [self.group, self.worker_id, *entry_ids])

    def write_step(self, pipe: ScriptPipeline, ttl_ms: int,
                   jobs: Sequence[tuple[str, str, str, Sequence[bytes], bool, bool, bool]]
                   ) -> int:
        """All jobs of a step in one script call: ``(job_id, owner, batch_id, events, create,
        check, refresh)`` each (``check``: this batch may have landed already, a retry after a
        lost reply; ``refresh``: reset the TTLs, see ``_WRITE_FN``); also reads each job's
        cancel flag. Parse the reply with ``parse_step_reply``."""
        keys: list[str] = []
        spec = []
        for job_id, owner, batch_id, events, create, check, refresh in jobs:
            keys += [self.keys.owner(job_id), self.keys.results(job_id), self.keys.cancel(job_id)]
            spec.append([owner, int(create), batch_id, int(check), list(events), int(refresh)])
        # Old-spec raw strings: Redis's cmsgpack does not read the bin types.
        return pipe.script(WRITE_STEP, keys, [int(ttl_ms), msgpack.packb(spec, use_bin_type=False)])

    def release(self, pipe: ScriptPipeline, job_id: str, owner: str) -> int:
        return pipe.script(RELEASE_OWNER, [self.keys.owner(job_id)], [owner])

    def ack(self, pipe: ScriptPipeline, lane_key: str, entry_ids: Sequence[str]) -> int:
        return pipe.script(ACK, [lane_key], [self.group, self.worker_id, *entry_ids])

    def park(self, pipe: ScriptPipeline, lane_key: str, entry_ids: Sequence[str]) -> int:
        return pipe.script(PARK, [lane_key], [self.group, self.worker_id, PARKING_CONSUMER,
                                              PARKED_IDLE_MS, *entry_ids])

    def claim_parked(self, pipe: ScriptPipeline, lane_key: str, count: int) -> int:
        return pipe.script(CLAIM_PARKED, [lane_key],
                           [self.group, self.worker_id, PARKING_CONSUMER, int(count)])

    def read_new(self, pipe: ScriptPipeline, lanes: Sequence[str], count: int) -> int:
        return pipe.script(READ_NEW, list(lanes), [self.group, self.worker_id, int(count)])

    def read_own_pending(self, pipe: ScriptPipeline, lane_key: str, start_id: str,
                         count: int) -> int:
        return pipe.script(READ_OWN_PENDING, [lane_key],
                           [self.group, self.worker_id, start_id, int(count)])


def parse_write_status(reply: Any) -> WriteStatus:
    text = _text(reply)
    return WriteStatus.ERROR if text.startswith("error") else WriteStatus(text)


_STEP_CODES = {"o": WriteStatus.OK, "d": WriteStatus.DUP, "r": WriteStatus.REFUSED,
               "m": WriteStatus.MISSING, "g": WriteStatus.GONE, "s": WriteStatus.SKIP,
               "e": WriteStatus.ERROR}


def parse_step_reply(reply: Any) -> list[tuple[WriteStatus, bool, str]]:
    """Per job of a write_step call: (status, cancel flag set, error text or status name)."""
    codes, cancels, errors = _text(reply[0]), _text(reply[1]), list(reply[2] or [])
    why = {int(errors[i]): _text(errors[i + 1]) for i in range(0, len(errors), 2)}
    out = []
    for j, (c, x) in enumerate(zip(codes, cancels), start=1):
        status = _STEP_CODES[c]
        out.append((status, x == "1", why.get(j, status.value)))
    return out


def parse_ack_codes(reply: Any) -> list[AckStatus]:
    return [AckStatus(int(c)) for c in reply]


def parse_raw_entries(reply: Any) -> list[tuple[str, Optional[dict[bytes, bytes]], int]]:
    """``{id, fields|false, deliveries}`` rows (CLAIM_PARKED, READ_OWN_PENDING) as
    ``(entry_id, fields or None, deliveries)``; None means the entry was deleted."""
    out = []
    for row in reply or []:
        entry_id, raw_fields, deliveries = _text(row[0]), row[1], int(row[2] or 0)
        fields: Optional[dict[bytes, bytes]] = None
        if raw_fields:
            flat = list(raw_fields)
            fields = fields_of(dict(zip(flat[0::2], flat[1::2])))
        out.append((entry_id, fields, deliveries))
    return out


def fields_of(entry_fields: Any) -> dict[bytes, bytes]:
    return {(k if isinstance(k, bytes) else str(k).encode()): v for k, v in entry_fields.items()}


__all__ = ["LuaScript", "WRITE_EVENTS", "WRITE_STEP", "parse_step_reply", "ACK", "PARK", "CLAIM_PARKED", "READ_OWN_PENDING",
           "RENEW", "RELEASE_OWNER", "ALL_SCRIPTS", "WriteStatus", "AckStatus", "ScriptPipeline", "Fence",
           "new_owner_value", "parse_write_status", "parse_ack_codes", "parse_raw_entries",
           "BATCH_FIELD"]
