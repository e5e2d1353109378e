"""The producers' one script on the reading side: letting go of a stale dedupe record.

A reader that waits for a job Redis lost (restarted without its data) puts the job back in its
queue under the same id from the request it holds (docs/protocol.md, "What a waiting reader
decides by itself"). The enqueue script refuses a job id whose dedupe record exists; normally
a lost job's record is lost with it, but a worker that wrote to the job after the restart can
have created the record again, naming an entry that no longer exists. Such a record names
nothing anyone will run, and only blocks the id.
"""

from __future__ import annotations

from tokenrelay.protocol.scripts.lua import lua

# KEYS: the job's dedupe record, the lane (or affinity stream) the record names.
# ARGV: the record's value as the reader read it, the entry id it names.
# Reply: 1 when the record was let go (it expires at once: PEXPIRE 1, so no DEL permission is
# needed), 0 when it changed or its entry is back (then it is not stale; nothing is done).
# The record and its lane carry the same shard tag: one slot.
FORGET_STALE_RECORD = lua("forget_stale_record", """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if #redis.call('XRANGE', KEYS[2], ARGV[2], ARGV[2]) > 0 then return 0 end
redis.call('PEXPIRE', KEYS[1], 1)
return 1
""")

__all__ = ["FORGET_STALE_RECORD"]
