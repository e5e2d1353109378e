"""Every Lua script the worker runs, and the pipeline that sends them in one round trip per node.

Why scripts at all: XACK, XCLAIM and XADD take no "expected owner", so every read-modify step
that depends on *who* holds an entry or owns a job runs inside one script, atomically. A worker
waking from a pause (GC, SIGSTOP, a long step) must not renew, ack or write what another worker
took over meanwhile.

Field names come from ``protocol.wire`` (``$event``/``$batch``/``$payload`` below are
substituted once at import), never literals. Scripts are sent as EVALSHA in a
``ScriptPipeline``; a NOSCRIPT reply (Redis restarted or its script cache was flushed) is
retried with EVAL for that command only, so a step costs one round trip per node, not a SCRIPT
EXISTS round trip more as redis-py's pipelined ``Script`` objects do. Every script's keys share
one hash slot (one queue shard's tag, see ``Keys``), as a Redis Cluster requires.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from string import Template
from typing import Any, Optional, Sequence

import redis

from protocol.keys import BATCH_FIELD, DEDUPE_SEPARATOR, EVENT_FIELD, PAYLOAD_FIELD
from protocol.topology import send_packed


@dataclass(frozen=True)
class LuaScript:
    name: str
    source: str

    @property
    def sha(self) -> str:
        return hashlib.sha1(self.source.encode()).hexdigest()


def _lua(name: str, source: str) -> LuaScript:
    return LuaScript(name, Template(source).substitute(
        event=EVENT_FIELD.decode(), batch=BATCH_FIELD.decode(), payload=PAYLOAD_FIELD.decode(),
        sep=DEDUPE_SEPARATOR))


# ------------------------------------------------------------------------------ result writes
# The fenced append; ``cur`` is the owner record's value as read by the caller (false when
# absent). Each event entry gets field $batch = "<batch id>:<k>" (k = 1..n). ``expect`` is ''
# for a plain append, else the writer is unsure what the stream holds (a reply was lost, or
# Redis failed over) and ``expect`` names the $batch mark of the last entry it knows landed
# ('^': none, or an entry without a mark). Then the stream's last entry decides: a mark of this
# batch says how much of it already landed (only the rest is written); ``expect`` itself means
# nothing was lost; anything else means the stream lost events the writer saw acknowledged (a
# failover to a replica that had not received them: Redis replicates asynchronously), and the
# append returns 'behind' without writing, so the worker resumes the job from what survived
# instead of leaving a gap. An unsure writer whose owner record is gone is 'behind' too (the
# record may have been lost the same way). After the first write (create = 0) XADD runs with
# NOMKSTREAM: an expired stream is never recreated. The TTLs of the result stream and the owner
# record are (re)set when the stream is created, on a checked write and when ``refresh`` is 1
# (the worker asks for that when a TTL is due or the batch is terminal), not on every step: two
# PEXPIREs per job per step were a third of the step script's time. Returns ok | dup | refused
# (another owner) | missing (owner record expired) | gone (result stream expired) | behind.
_APPEND = """
local function last_mark(kr)
  local last = redis.call('XREVRANGE', kr, '+', '-', 'COUNT', 1)
  if #last == 0 then return '^' end
  local f = last[1][2]
  for i = 1, #f, 2 do
    if f[i] == '$batch' then return f[i + 1] end
  end
  return '^'
end

local function append(cur, ko, kr, owner, ttl, create, batch, events, expect, refresh)
  if not cur then
    if expect ~= '' then return 'behind' end
    return 'missing'
  end
  if cur ~= owner then return 'refused' end
  local n = #events
  local done = 0
  if expect ~= '' then
    local mark = last_mark(kr)
    local prefix = batch .. ':'
    if string.sub(mark, 1, #prefix) == prefix then
      done = tonumber(string.sub(mark, #prefix + 1)) or 0
    elseif mark ~= expect then
      return 'behind'
    end
  end
  for k = done + 1, n do
    local id
    if create == 1 then
      id = redis.call('XADD', kr, '*', '$event', events[k], '$batch', batch .. ':' .. k)
    else
      id = redis.call('XADD', kr, 'NOMKSTREAM', '*', '$event', events[k], '$batch', batch .. ':' .. k)
    end
    if not id then return 'gone' end
  end
  if create == 1 or expect ~= '' or refresh == 1 then
    redis.call('PEXPIRE', kr, ttl)
    redis.call('PEXPIRE', ko, ttl)
  end
  if done >= n then return 'dup' end
  return 'ok'
end
"""

# One call for every job of an engine step. KEYS: per job owner, results, cancel. ARGV[1]: ttl
# ms; ARGV[2]: msgpack array, per job [owner value, create 0/1, batch id, expect ('' or a
# mark, see _APPEND), [events], refresh 0/1]. Owners and cancel flags are read with one MGET each. Returns {status letters,
# cancel flags ('0'/'1' per job), {job number, error, ...}}, one letter per job: o ok, d dup,
# r refused, m missing, g gone, b behind, s skip (no events), e error. Each job is isolated (pcall): one
# job's broken key never fails another job's write (MGET reads a key of the wrong type as absent).
WRITE_STEP = _lua("write_step", _APPEND + """
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

# Identity binding, then ownership. KEYS: dedupe record, owner. ARGV: this entry's dedupe record
# ("<lane key> <entry id>"), owner value, owner ttl ms, dedupe ttl s. A job id is bound to the
# entry its dedupe record names: absent (a raw producer, or expired) -> bind it to this entry
# (SET NX) and own the job; names this entry -> own the job; names another entry -> touch
# nothing and return that record (the worker rejects this entry as duplicate_job_id).
BIND_AND_OWN = _lua("bind_and_own", """
local rec = redis.call('GET', KEYS[1])
if not rec then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[4], 'NX')
elseif rec ~= ARGV[1] then
  return rec
end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
return 1
""")

# KEYS: owner. ARGV: owner value. Deletes the owner record only if it is still ours.
RELEASE_OWNER = _lua("release_owner", """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
""")

# The one dead-letter write. KEYS: dead stream[, dedupe, owner, results when the job id is
# known]. ARGV: maxlen, dedupe record of the entry, owner value, ttl ms, dedupe ttl s, error
# event ('' = none), then the dead letter's flat fields. Copies the entry to the capped
# dead-letter stream, then ends the job's result stream with the error event unless the job id
# is bound to another entry (never touch another live job: returns 'other') or the stream
# already ended ('ended'). Taking the owner record fences out a paused former holder.
DEAD_LETTER = _lua("dead_letter", """
local fields = {}
for i = 7, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', unpack(fields))
if #KEYS < 4 or ARGV[6] == '' then return 'nojob' end
local rec = redis.call('GET', KEYS[2])
if rec and rec ~= ARGV[2] then return 'other' end
if not rec then redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[5], 'NX') end
local last = redis.call('XREVRANGE', KEYS[4], '+', '-', 'COUNT', 1)
if #last == 1 then
  local f = last[1][2]
  for i = 1, #f, 2 do
    if f[i] == '$event' then
      local ok, ev = pcall(cmsgpack.unpack, f[i + 1])
      if ok and type(ev) == 'table' and (ev['type'] == 'done' or ev['type'] == 'error') then
        return 'ended'
      end
    end
  end
end
redis.call('SET', KEYS[3], ARGV[3], 'PX', ARGV[4])
redis.call('XADD', KEYS[4], '*', '$event', ARGV[6])
redis.call('PEXPIRE', KEYS[4], ARGV[4])
return 'written'
""")

# ------------------------------------------------------------------------------ pending lists
# KEYS: one queue shard's lanes, most urgent first. ARGV: group, consumer, count, parking
# consumer. Up to count entries in all, lane by lane, urgent first; in each lane first the
# entries parked there (a draining worker's hand-backs, another worker's surplus read: taken with
# XCLAIM ... JUSTID, their delivery count kept), then new ones (XREADGROUP >), in one round trip:
# {lane index, id, fields|false (deleted while parked), deliveries, parked 0/1}.
READ_NEW = _lua("read_new", """
local out = {}
local want = tonumber(ARGV[3])
for i = 1, #KEYS do
  if want <= 0 then break end
  for _, p in ipairs(redis.call('XPENDING', KEYS[i], ARGV[1], '-', '+', want, ARGV[4])) do
    redis.call('XCLAIM', KEYS[i], ARGV[1], ARGV[2], 0, p[1], 'JUSTID')
    local e = redis.call('XRANGE', KEYS[i], p[1], p[1])
    local body = false
    if #e == 1 then body = e[1][2] end
    out[#out + 1] = {i, p[1], body, p[4], 1}
    want = want - 1
  end
  if want > 0 then
    local r = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', want, 'STREAMS',
                         KEYS[i], '>')
    if r and r[1] then
      for _, e in ipairs(r[1][2]) do
        out[#out + 1] = {i, e[1], e[2], 1, 0}
        want = want - 1
      end
    end
  end
end
return out
""")

# KEYS: lane. ARGV: group, consumer, start id, count. This consumer's pending entries after
# start id (XREADGROUP ... <id>), as {id, fields|false (deleted), deliveries}. In Lua so that the
# nil body of a deleted entry survives client-side parsing.
READ_OWN_PENDING = _lua("read_own_pending", """
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

# KEYS: lane. ARGV: group, me, min idle ms ('' = parked entries only), cursor, count, parking
# consumer -> {next cursor, {{id, fields|false, deliveries}, ...}, {deleted id, ...}}.
# Entries a draining worker parked come first and keep their delivery count (a hand-back is not
# a failed delivery). Then XAUTOCLAIM ... JUSTID gives the ids on both 6.2 and 7 (6.2 replies
# with a bare nil for a deleted entry); each body is read with XRANGE and the count raised by one
# by hand, so counts are exactly those of this delivery. Redis 7's third element (ids deleted
# from the stream, already dropped from the pending list) is passed through.
RECLAIM = _lua("reclaim", """
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
local cursor = '0-0'
if ARGV[3] ~= '' and #out < count then
  local r = redis.call('XAUTOCLAIM', lane, group, me, ARGV[3], ARGV[4], 'COUNT', count - #out,
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
""")

# KEYS: lane. ARGV: group, me, target consumer, idle ms, then pairs (id, count; '' keeps the
# count) -> the ids NOT pending under me (untouched). Every hold-changing step of an entry this
# worker holds: renew (target me, idle 0), park (target the parking consumer, idle huge),
# release counting a delivery (target me, idle huge), restore counts (target me, idle 0, count).
# Only entries still pending under me are touched: XCLAIM with min-idle 0 would otherwise steal
# an entry back from the worker that legitimately reclaimed it while we were paused.
MOVE_MINE = _lua("move_mine", """
local lane, group, me = KEYS[1], ARGV[1], ARGV[2]
local lost = {}
for i = 5, #ARGV, 2 do
  local id, count = ARGV[i], ARGV[i + 1]
  local p = redis.call('XPENDING', lane, group, id, id, 1)
  if #p == 1 and p[1][2] == me then
    if count == '' then
      redis.call('XCLAIM', lane, group, ARGV[3], 0, id, 'IDLE', ARGV[4], 'JUSTID')
    else
      redis.call('XCLAIM', lane, group, ARGV[3], 0, id, 'IDLE', ARGV[4], 'RETRYCOUNT', count,
                 'JUSTID')
    end
  else
    lost[#lost + 1] = id
  end
end
return lost
""")

# KEYS: lane. ARGV: group, consumer, ids... One code per id: 1 acked and deleted (the stream
# never holds finished jobs and needs no MAXLEN trimming), 0 not pending (already acked or never
# delivered), -1 pending at another consumer (untouched).
ACK = _lua("ack", """
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

# KEYS: lane, dedupe record, result stream, owner, cancel. ARGV: payload, ttl s (used when the
# record is absent) -> the new entry id. Admin replay of a dead letter: the job's old stream and
# keys go, and the new entry and the record naming it appear at once, so no worker can read the
# entry while the record still names the old one (it would reject it as duplicate_job_id).
REPLAY = _lua("replay", """
redis.call('DEL', KEYS[3], KEYS[4], KEYS[5])
local id = redis.call('XADD', KEYS[1], '*', '$payload', ARGV[1])
local rec = KEYS[1] .. '$sep' .. id
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('SET', KEYS[2], rec, 'KEEPTTL')
else
  redis.call('SET', KEYS[2], rec, 'EX', ARGV[2])
end
return id
""")

# ------------------------------------------------------------------------------ worker id
# KEYS: heartbeat hash; ARGV: instance, ttl ms, force -> the instance holding the id now.
ID_CLAIM = _lua("id_claim", """
local cur = redis.call('HGET', KEYS[1], 'instance')
if cur and cur ~= ARGV[1] and ARGV[3] ~= '1' then return cur end
redis.call('HSET', KEYS[1], 'instance', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return ARGV[1]
""")

# KEYS: heartbeat hash; ARGV: instance -> 1 when deleted (it was ours).
ID_RELEASE = _lua("id_release", """
if redis.call('HGET', KEYS[1], 'instance') == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
""")


def _arg(value: Any) -> bytes:
    """One command argument as RESP bytes, as redis-py's encoder writes it."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bool):
        raise TypeError("a bool is no Redis argument; send 0/1")
    if isinstance(value, (int, float)):
        return repr(value).encode()
    raise TypeError(f"cannot send {type(value).__name__} to Redis")


def pack(args: Sequence[Any]) -> bytes:
    """One command in RESP. On the per-step path: as fast as redis-py's packer (a step's
    WRITE_STEP has three keys per job), which needs a connection this side does not have yet."""
    out = [b"*%d\r\n" % len(args)]
    add = out.append
    for a in args:
        t = type(a)
        if t is str:
            a = a.encode()
        elif t is int:
            a = b"%d" % a
        elif t is not bytes:
            a = _arg(a)
        add(b"$%d\r\n%b\r\n" % (len(a), a))
    return b"".join(out)


class ScriptPipeline:
    """A non-transactional pipeline whose script calls survive a script-cache flush, sent to
    the node of each command's keys.

    Every command is packed here and sent with ``topology.send_packed``: grouped by the Redis
    Cluster node that serves its routing key (a script's first key, a command's first argument
    after its name), every node's commands written before any reply is read, so a batch costs
    one round trip per node however many jobs it carries (one round trip on a single Redis).
    redis-py's pipeline machinery is not used: it cost more than Redis's own work for a step.
    ``execute`` returns one raw RESP2 reply per command (no redis-py response callbacks), error
    replies in place (never raised), except connection errors, which propagate: the caller
    reconnects and retries the whole batch, which is safe because every write here is
    idempotent (batch ids, XPENDING-checked acks). A NOSCRIPT reply (Redis restarted, a
    failover to a replica that never saw the script, a flushed cache) is retried with EVAL for
    that command only, on its node.
    """

    def __init__(self, client: Any) -> None:
        self._client = client
        self._cmds: list[tuple[Optional[LuaScript], tuple[Any, ...], Any]] = []

    def __len__(self) -> int:
        return len(self._cmds)

    def command(self, *args: Any, key: Any = None) -> int:
        """Queue a plain command; routed by ``key`` (default: its first argument)."""
        self._cmds.append((None, args, key if key is not None else
                           (args[1] if len(args) > 1 else None)))
        return len(self._cmds) - 1

    def script(self, script: LuaScript, keys: Sequence[Any], args: Sequence[Any]) -> int:
        """Queue a script call; all its keys must share a slot (routed by the first)."""
        self._cmds.append((script, (len(keys), *keys, *args), keys[0] if keys else None))
        return len(self._cmds) - 1

    def execute(self) -> list[Any]:
        if not self._cmds:
            return []
        results = send_packed(self._client, [
            (key, pack(("EVALSHA", script.sha, *args) if script is not None else args), 1)
            for script, args, key in self._cmds])
        missing = [i for i, r in enumerate(results) if isinstance(r, redis.exceptions.NoScriptError)]
        if missing:
            again = send_packed(self._client, [
                (self._cmds[i][2], pack(("EVAL", self._cmds[i][0].source, *self._cmds[i][1])), 1)
                for i in missing])
            for i, r in zip(missing, again):
                results[i] = r
        return results


def run_script(client: Any, script: LuaScript, keys: Sequence[Any],
               args: Sequence[Any]) -> Any:
    """One script call now (NOSCRIPT-safe); an error reply is raised."""
    pipe = ScriptPipeline(client)
    pipe.script(script, keys, args)
    (reply,) = pipe.execute()
    if isinstance(reply, Exception):
        raise reply
    return reply


def text(v: Any) -> str:
    """Replies arrive as bytes or str depending on the client's decode_responses."""
    return v.decode() if isinstance(v, bytes) else str(v)
