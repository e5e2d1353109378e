"""The pending-list scripts: every read-modify step on who holds a job stream entry.

XACK and XCLAIM take no "expected holder", so every step that depends on *who* holds an entry
runs inside one script, atomically: a worker waking from a pause must not renew, park or ack
what another worker reclaimed meanwhile. Each script's keys are one lane, or the lanes of one
queue shard (one slot).
"""

from __future__ import annotations

from tokenrelay.protocol.scripts.lua import lua

# KEYS: one queue shard's lanes, most urgent first. ARGV: group, consumer, count, parking
# consumer. Up to count entries in all, lane by lane, urgent first; in each lane first the
# entries parked there (a draining worker's hand-backs, another worker's surplus read: taken with
# XCLAIM ... JUSTID, their delivery count kept), then new ones (XREADGROUP >), in one round trip:
# {lane index, id, fields|false (deleted while parked), deliveries, parked 0/1}.
READ_NEW = lua("read_new", """
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
READ_OWN_PENDING = lua("read_own_pending", """
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
RECLAIM = lua("reclaim", """
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
MOVE_MINE = lua("move_mine", """
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
ACK = lua("ack", """
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

# KEYS: one lane. ARGV: group, consumer (a departed worker's id).
# Removes the consumer from the group (XGROUP DELCONSUMER) only when it holds no pending entry
# of this lane, checked in the same atomic step: DELCONSUMER drops the entries a consumer still
# holds from the pending list, where nobody could reclaim them any more. Reply: 1 removed, 0
# kept (it holds entries: reclaim them first).
DROP_CONSUMER = lua("drop_consumer", """
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return 1
""")
