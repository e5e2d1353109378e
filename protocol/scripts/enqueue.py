"""The producers' enqueue script: the one way a job enters a queue (producer_sdk/core/enqueue.py packs
its calls; the sync and async clients send them).
"""

from __future__ import annotations

from tokenrelay.protocol.scripts.lua import lua

# One script call enqueues a chunk of jobs of one lane of one queue shard: per job, SET-if-absent
# of the dedupe record and XADD happen atomically, so a retried call (redis-py retries on
# timeouts) never enqueues twice. Every key is in the shard's slot (its hash tag): a Redis
# Cluster runs the call on the master of that slot.
# KEYS: target lane, the shard's three lanes (its depth), the shard's token budget counter
# (``Keys.budget``), then one dedupe key per job.
# A target that is none of the three lanes is a worker's affinity stream on that shard
# (producer_sdk/core/affinity.py); KEYS[2] is then the jobs' own lane, where they go instead when
# that stream does not exist: its worker deleted it when it drained, or a sweep did after it
# died, so a job routed on a stale view of the workers is never left where nobody reads.
# Depth is the shared lanes' (affinity streams are bounded per worker by the producer's
# affinity_max_backlog): a routed job is refused like any other past the mark, but one written
# to an affinity stream adds nothing to the depth (``step`` 0).
# Token budget (protocol/budget.py): each new job's cost is stored in its entry ($cost) and
# added to the shard's counter, routed jobs too; past the shard's share of max_queued_tokens
# a job is refused unless the counter is 0 (one job always fits an empty shard). The script
# writing the job's terminal event subtracts the stored cost (protocol/scripts/results.py). A
# counter that is no integer (a key overwritten by hand) is set to 0 and counts from there:
# enqueueing never fails for it, and ``worker admin recount-budget`` restores the true sum.
# ARGV: limit (0: none), dedupe TTL, depth of the queue's other shards (read by the caller just
# before; 0 for a one-shard queue), durable ('1': make sure the call writes, see below), token
# limit of this shard (0: none), then per job its payload and its cost.
# Reply: {depth when the job count refused or -1, limit, the shard's tokens when the budget
# refused or -1, token limit, then per accepted/known job either 1 (enqueued: its entry id is in
# its dedupe record; an integer is cheaper to return than the id) or '=' .. the existing dedupe
# record}. Jobs past the reply's end were refused (full).
# Per job the common case costs one XADD and one SET NX (the record written only if absent):
# a GET first would be a third call for every job (measured 6.0-8.3 vs 4.4-6.6 us a job in a
# Lua-only bench at load 3.6, within noise at load 4.5). A job the
# SET finds known has its entry deleted again at once (XDEL), inside the script, so no reader
# ever sees it; a job meeting a full queue or budget is looked up first instead, so a known job
# is still answered as known there, never refused.
# Durable: WAIT (sent by the caller right after) counts replicas that acknowledged this
# connection's last write; a call whose jobs were all known enqueues nothing (the entries it
# added are deleted again), so it rewrites one known record unchanged (SET .. KEEPTTL):
# acknowledging that proves the replicas also hold the
# earlier write that enqueued the job (replication is one ordered stream).
ENQUEUE = lua("enqueue", """
local limit = tonumber(ARGV[1])
local depth = tonumber(ARGV[3]) + redis.call('XLEN', KEYS[2]) + redis.call('XLEN', KEYS[3])
  + redis.call('XLEN', KEYS[4])
local tlimit = tonumber(ARGV[5])
local raw = redis.pcall('GET', KEYS[5])
local used = tonumber(raw)
if not used then
  if raw then redis.call('SET', KEYS[5], 0) end
  used = 0
end
local lane = KEYS[1]
local step = 1
if lane ~= KEYS[2] and lane ~= KEYS[3] and lane ~= KEYS[4] then
  step = 0
  if redis.call('EXISTS', lane) == 0 then
    lane = KEYS[2]
    step = 1
  end
end
local ttl = ARGV[2]
local out = {-1, limit, -1, tlimit}
local k = 4
local wrote, known, added = false, nil, 0
local function finish()
  if added > 0 then redis.call('INCRBY', KEYS[5], added) end
  if ARGV[4] == '1' and not wrote and known then
    redis.call('SET', known, redis.call('GET', known), 'KEEPTTL')
  end
  return out
end
for i = 1, #KEYS - 5 do
  local dk = KEYS[5 + i]
  local cost = ARGV[5 + 2 * i]
  local n = tonumber(cost)
  local full = limit > 0 and depth >= limit
  if full or (tlimit > 0 and used > 0 and used + n > tlimit) then
    local cur = redis.call('GET', dk)
    if not cur then
      if full then out[1] = depth else out[3] = used end
      return finish()
    end
    known = dk
    k = k + 1
    out[k] = '=' .. cur
  else
    local id = redis.call('XADD', lane, '*', '$payload', ARGV[4 + 2 * i], '$cost', cost)
    if redis.call('SET', dk, lane .. '$sep' .. id, 'NX', 'EX', ttl) then
      wrote = true
      depth = depth + step
      used = used + n
      added = added + n
      k = k + 1
      out[k] = 1
    else
      redis.call('XDEL', lane, id)
      known = dk
      k = k + 1
      out[k] = '=' .. redis.call('GET', dk)
    end
  end
end
return finish()
""")
