"""The affinity sweep's script: moving what nobody holds out of a worker's affinity stream back
to the shared lanes (worker/affinity.py says when and why).
"""

from __future__ import annotations

from tokenrelay.protocol.scripts.lua import lua

# KEYS: the affinity stream, the urgent, default and bulk lanes of its shard, then one key per
# entry: the job's dedupe record (the stream key again when the job id is unreadable).
# ARGV: group, parking consumer, delete-when-empty (1/0), then per entry: id, lane index (1-3),
# has-dedupe (1/0). Each entry still in the stream and pending at nobody (unread) or at the
# parking consumer is added to its lane with the same fields; the dedupe record, when it names
# this entry, is rewritten to name the new one (KEEPTTL); the old entry is acknowledged (if
# parked) and deleted. Entries a consumer holds are left to the lease. A stream left empty is
# deleted when asked, so producers' enqueues that name it fall back to the shared lane.
# Returns {moved, gone (1: the stream no longer exists)}.
MOVE_UNREAD = lua("move_unread", """
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
