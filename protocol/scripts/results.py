"""The result-stream scripts: the fenced write of a step's events, identity binding and
ownership, the owner's release, the one dead-letter write, and the admin's replay.

A worker waking from a pause (GC, SIGSTOP, a long step) must not write into a stream another
worker took over meanwhile, and XADD takes no "expected owner": so the owner check and the
write run in one script, atomically. Every script's keys share one queue shard's slot (its
hash tag, see ``Keys``).
"""

from __future__ import annotations

from tokenrelay.protocol.scripts.lua import lua

# The fenced append; ``cur`` is the owner record's value as read by the caller (false when
# absent). Each event entry gets field $batch = "<batch id>:<k>" (k = 1..n). ``known`` is how
# many entries the writer knows the stream holds (read at admission, plus every batch it saw
# land). EVERY write is checked against it, not only after an error the writer saw: a Redis
# restarted from an AOF that lost its last second (appendfsync everysec), or a replica promoted
# before it had the last writes, loses events the writer saw acknowledged, and the writer's
# client may reconnect without raising anything. Result streams are never trimmed, so XLEN
# (O(1), a fraction of a microsecond; the last entry's mark, XREVRANGE COUNT 1, cost ~4 us a
# job: benchmarks/step_script.py) decides: ``known`` means nothing was lost; more is a retry
# after a lost reply, and the last entry's mark says how much of this batch landed (only the
# rest is written; a length that does not match it is 'behind'); less is 'behind'. 'behind'
# writes nothing: the worker resumes the job from what survived, never leaving a gap.
# Records gone are never recreated: no owner record and no stream is 'missing' (expired, or a
# Redis that came back without its data: the job ends on the worker and its readers, who hold
# the request, enqueue it again or end it job_lost); a stream gone while the writer knows it
# held entries is 'gone' (only a first write, create = 1 and known = 0, creates the stream, so
# an expired stream is never recreated either). No owner record but a stream is 'behind' (the
# record was lost with the last second: resume, which takes ownership again). The TTLs of the
# result stream and the owner record are (re)set when the stream is created and when
# ``refresh`` is 1 (the worker asks for that when a TTL is due or the batch is terminal), not on
# every step: two PEXPIREs per job per step were a third of the step script's time. Returns ok |
# dup | refused (another owner) | missing | gone | behind.
_APPEND = """
local function landed(kr, prefix)
  local last = redis.call('XREVRANGE', kr, '+', '-', 'COUNT', 1)
  local f = last[1][2]
  for i = 1, #f, 2 do
    if f[i] == '$batch' and string.sub(f[i + 1], 1, #prefix) == prefix then
      return tonumber(string.sub(f[i + 1], #prefix + 1))
    end
  end
  return nil
end

local function append(cur, ko, kr, owner, ttl, create, batch, events, known, refresh)
  local len = redis.call('XLEN', kr)
  if not cur then
    if len > 0 then return 'behind' end
    return 'missing'
  end
  if cur ~= owner then return 'refused' end
  if len == 0 and (known > 0 or create ~= 1) then return 'gone' end
  local n = #events
  local prefix = batch .. ':'
  local done = 0
  if len > known then
    done = landed(kr, prefix)
    if done == nil or len - known ~= done then return 'behind' end
  elseif len < known then
    return 'behind'
  end
  for k = done + 1, n do
    redis.call('XADD', kr, '*', '$event', events[k], '$batch', prefix .. k)
  end
  if create == 1 or refresh == 1 then
    redis.call('PEXPIRE', kr, ttl)
    redis.call('PEXPIRE', ko, ttl)
  end
  if done >= n then return 'dup' end
  return 'ok'
end
"""

# Returning a job's cost to its shard's token budget counter. A counter that is no integer
# (overwritten by hand) never fails the write: the release is skipped and a recount repairs the
# counter. A user whose ACL lacks DECRBY gets NOPERM back (Redis 7.0 words it "can't run this
# command"; the worker exits 78 naming it) rather than a budget that silently never empties.
_RELEASE = """
local function release(key, cost)
  local r = redis.pcall('DECRBY', key, cost)
  if type(r) == 'table' and r.err and (string.find(r.err, 'NOPERM', 1, true)
      or string.find(r.err, "can't run this command", 1, true)) then
    return 'NOPERM the token budget release needs DECRBY: ' .. r.err
  end
  return nil
end
"""

# One call for every job of an engine step. KEYS: per job owner, results, cancel; then the
# shard's token budget counter (``Keys.budget``, always the last key). ARGV[1]: ttl ms; ARGV[2]:
# msgpack array, per job [owner value, create 0/1, batch id, known (entries the writer
# knows the stream holds; see _APPEND),
# [events], refresh 0/1, release]: ``release`` is the job's admitted cost (its entry's $cost)
# when the batch ends with its terminal event, else 0. It is subtracted from the counter when
# that append writes the batch's last event ('ok': a 'dup' batch landed before, and released
# then), so the budget is released exactly once, with the one terminal event of the job (see
# _RELEASE for a counter that is no integer, and for a missing permission: status e).
# Owners and cancel flags are read with one MGET each.
# Returns {status letters, cancel flags ('0'/'1' per job), {job number, error, ...}}, one letter
# per job: o ok, d dup, r refused, m missing, g gone, b behind, s skip (no events), e error. Each
# job is isolated (pcall): one job's broken key never fails another job's write (MGET reads a key
# of the wrong type as absent).
WRITE_STEP = lua("write_step", _APPEND + _RELEASE + """
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
      if res == 'ok' and (job[7] or 0) > 0 then
        local denied = release(KEYS[#KEYS], job[7])
        if denied then
          st = 'e'
          errors[#errors + 1] = j
          errors[#errors + 1] = denied
        end
      end
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

# Identity binding, then ownership. KEYS: dedupe record, owner, the entry's lane (same slot: the
# shard's hash tag). ARGV: this entry's dedupe record ("<lane key> <entry id>"), owner value,
# owner ttl ms, dedupe ttl s, entry id. An entry its lane no longer holds (a Redis that came
# back without its data, while the worker held the entry in memory; workers delete an entry
# only after its job's terminal event) -> touch nothing and return 'lost': recreating the
# job's records would start a second run beside the one its readers enqueue again. Else a job
# id is bound to the entry its dedupe record names: absent (a raw producer, or expired) -> bind
# it to this entry (SET NX) and own the job; names this entry -> own the job; names another
# entry -> touch nothing and return that record (the worker rejects this entry as
# duplicate_job_id).
BIND_AND_OWN = lua("bind_and_own", """
if #redis.call('XRANGE', KEYS[3], ARGV[5], ARGV[5]) == 0 then return 'lost' end
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
RELEASE_OWNER = lua("release_owner", """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
""")

# The one dead-letter write. KEYS: dead stream[, dedupe, owner, results, the shard's token
# budget counter when the job id is known]. ARGV: maxlen, dedupe record of the entry, owner
# value, ttl ms, dedupe ttl s, error event ('' = none), the entry's admitted cost ($cost, '0'
# none), then the dead letter's flat fields. Copies the entry to the capped dead-letter stream,
# then ends the job's result stream with the error event unless the job id is bound to another
# entry (never touch another live job: returns 'other') or the stream already ended ('ended':
# its terminal write released the cost); writing that terminal event releases the cost.
# Taking the owner record fences out a paused former holder.
DEAD_LETTER = lua("dead_letter", _RELEASE + """
local fields = {}
for i = 8, #ARGV do fields[#fields + 1] = ARGV[i] end
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
if #KEYS >= 5 and (tonumber(ARGV[7]) or 0) > 0 then
  local denied = release(KEYS[5], ARGV[7])
  if denied then return redis.error_reply(denied) end
end
return 'written'
""")

# KEYS: lane, dedupe record, result stream, owner, cancel. ARGV: payload, ttl s (used when the
# record is absent) -> the new entry id. Admin replay of a dead letter: the job's old stream and
# keys go, and the new entry and the record naming it appear at once, so no worker can read the
# entry while the record still names the old one (it would reject it as duplicate_job_id).
REPLAY = lua("replay", """
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
