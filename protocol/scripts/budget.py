"""The token budget's repair: a recount of one queue shard's counter from its streams.

The counter (``Keys.budget``) is kept by the enqueue script (adds a new job's cost) and by the
scripts writing a job's terminal event (subtract it), each atomically with the write it counts,
so it drifts only where Redis itself lost or undid writes (a restart from an older AOF, a
failover that lost a suffix, an entry deleted by hand, a result stream that expired before its
job ended). What it should hold is the sum of the costs stored in the entries still in the
shard's streams, less those whose terminal event is written and whose ack has not yet deleted
them; one script computes that and sets it, atomically with respect to enqueues and releases.
"""

from __future__ import annotations

from tokenrelay.protocol.scripts.lua import lua

# KEYS: the shard's budget counter, then the streams of the shard that hold its jobs (its three
# lanes and the affinity streams of the queue's workers on that shard). ARGV: entries to leave
# out, each '<KEYS index>/<entry id>': jobs whose terminal event is written (released already)
# and whose entries wait for their ack. Sums the $cost field of every other entry, sets the
# counter to it and returns {the counter before (false: none), the counter now}.
RECOUNT_BUDGET = lua("recount_budget", """
local skip = {}
for i = 1, #ARGV do skip[ARGV[i]] = true end
local total = 0
for k = 2, #KEYS do
  local start = '-'
  while true do
    local page = redis.call('XRANGE', KEYS[k], start, '+', 'COUNT', 1000)
    for _, e in ipairs(page) do
      if not skip[k .. '/' .. e[1]] then
        local f = e[2]
        for j = 1, #f, 2 do
          if f[j] == '$cost' then
            total = total + math.max(0, tonumber(f[j + 1]) or 0)
            break
          end
        end
      end
    end
    if #page < 1000 then break end
    start = '(' .. page[#page][1]
  end
end
local before = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], total)
return {before or false, total}
""")
