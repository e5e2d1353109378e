"""Cancel by id, bound to a job that exists (producer_sdk: ``cancel``, a window's or the
gateway's cancels, a reader ending an overdue job).

Why a script: a cancel flag set for an id Redis does not know used to outlive the request by a
day and cancel a later job submitted under that id. The check that the job's records exist and
the SET of the flag must be one atomic step, or a job could be enqueued (or its records expire)
between them.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from tokenrelay.protocol.keys import Keys
from tokenrelay.protocol.scripts.lua import lua


class CancelTarget(NamedTuple):
    """The KEYS of one ``CANCEL_KNOWN`` call, in contract order (all in the job's shard slot)."""

    flag: str
    dedupe: str
    results: str
    owner: str


def cancel_target(keys: Keys, job_id: str, shard: Optional[int] = None) -> CancelTarget:
    """The cancel script's keys for ``job_id`` of ``keys``' queue (``shard`` None: its id's)."""
    return CancelTarget(keys.cancel(job_id, shard), keys.dedupe(job_id, shard),
                        keys.results(job_id, shard), keys.owner(job_id, shard))


# KEYS: the job's cancel flag, dedupe record, result stream, fencing (owner) record.
# ARGV: the flag's TTL in seconds.
# Reply: 1 when the flag was set, 0 when none of the job's records exists (an unknown id, or a
# job whose records all expired): nothing is written then.
# The flag expires with the job's records (the longest remaining TTL among them, at most the
# TTL asked for; a record without a TTL keeps the TTL asked for), so no flag outlives the job it
# was set for and cancels a later job submitted under the same id.
CANCEL_KNOWN = lua("cancel_known", """
local ttl = tonumber(ARGV[1]) * 1000
local known, longest, forever = false, 0, false
for i = 2, #KEYS do
  local left = redis.call('PTTL', KEYS[i])
  if left == -1 then
    known, forever = true, true
  elseif left > 0 then
    known = true
    if left > longest then longest = left end
  end
end
if not known then return 0 end
if not forever and longest < ttl then ttl = longest end
redis.call('SET', KEYS[1], '1', 'PX', ttl)
return 1
""")

__all__ = ["CANCEL_KNOWN", "CancelTarget", "cancel_target"]
