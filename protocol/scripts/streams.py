"""The gateway's resumable SSE streams: who holds a job's stream, and when a client that left
loses it (``producer_sdk/gateway/resume.py``; docs/gateway.md, Resumable streams).

Why scripts: a client may reconnect to any gateway replica at the very moment its grace runs
out, and two clients may resume one stream at once. The check of the record's state and its
change must be one atomic step, so a resume and the grace's expiry can never both win (a
resumed stream whose job is then cancelled would be a half-stream). Time is Redis's ``TIME``,
not a gateway's clock, so replicas whose clocks disagree still agree on when a grace ends.

The record (``protocol.keys.stream_session_key``) is a hash; the fields these scripts read and
write are ``owner`` (digest of the API key that started the job), ``digest`` (of its request
body), ``spec`` (what rendering the stream takes, JSON, read by the gateway), ``state`` (``live``,
``parked``, ``ended``, ``cancelled``), ``token`` (the connection that holds a ``live`` stream)
and ``until`` (epoch ms a ``parked`` stream's grace ends). One key per script: its own slot.
"""

from __future__ import annotations

from tokenrelay.protocol.scripts.lua import lua

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: the stream's resume record.
# ARGV: the caller's owner digest, the new connection's token, the digest of the request body
# it resent ('' for none: a resume by job id).
# Reply: {'claimed', <state before>, <spec>} when the caller now holds the stream (a live
# stream is taken over: the newest connection wins; an ended one stays ended), {'missing'}
# without a record, {'forbidden'} for another owner, {'mismatch'} for another body (nothing
# changed), {'cancelled'} when its grace had already run out, {'expired'} when it runs out now
# (the record becomes cancelled: the caller cancels the job).
CLAIM_STREAM = lua("claim_stream", """
local rec = redis.call('HMGET', KEYS[1], 'owner', 'state', 'until', 'digest', 'spec')
if not rec[1] then return {'missing'} end
if rec[1] ~= ARGV[1] then return {'forbidden'} end
if ARGV[3] ~= '' and rec[4] ~= ARGV[3] then return {'mismatch'} end
if rec[2] == 'cancelled' then return {'cancelled'} end
if rec[2] == 'parked' then
""" + _NOW + """
  if now >= tonumber(rec[3]) then
    redis.call('HSET', KEYS[1], 'state', 'cancelled')
    return {'expired', rec[5]}
  end
end
if rec[2] == 'ended' then
  redis.call('HSET', KEYS[1], 'token', ARGV[2])
else
  redis.call('HSET', KEYS[1], 'state', 'live', 'token', ARGV[2])
end
return {'claimed', rec[2], rec[5]}
""")

# KEYS: the stream's resume record.
# ARGV: the token of the connection that left, the grace in ms, the record's TTL in ms.
# Reply: the epoch ms the grace ends (the record then lives the TTL from now, so it outlives
# the grace), 0 when that connection no longer held the stream (another resumed it, or it
# ended): then nothing is changed, -1 when the record is gone (it outlived its TTL: the caller
# cancels the job at once, as nobody could resume it).
PARK_STREAM = lua("park_stream", """
local rec = redis.call('HMGET', KEYS[1], 'state', 'token')
if not rec[1] then return -1 end
if rec[1] ~= 'live' or rec[2] ~= ARGV[1] then return 0 end
""" + _NOW + """
local ends = now + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'state', 'parked', 'until', ends)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return ends
""")

# KEYS: the stream's resume record.
# ARGV: none.
# Reply: {'cancel', <spec>} when its grace ran out now (the record becomes cancelled: the
# caller cancels the job), {'wait', <ms left>} while it is parked and its grace runs,
# {'skip'} when it is not parked (resumed, ended, already cancelled or gone).
EXPIRE_PARKED = lua("expire_parked", """
local rec = redis.call('HMGET', KEYS[1], 'state', 'until', 'spec')
if rec[1] ~= 'parked' then return {'skip'} end
""" + _NOW + """
local ends = tonumber(rec[2])
if now < ends then return {'wait', ends - now} end
redis.call('HSET', KEYS[1], 'state', 'cancelled')
return {'cancel', rec[3]}
""")

# KEYS: the stream's resume record.
# ARGV: the record's TTL in ms.
# Reply: 1 when the record now says ended, 0 when it is gone or its grace already ran out.
# Written when a connection read the job's terminal event: the stream stays resumable for the
# TTL from now and is never parked or cancelled again. No HSET on a missing key (it would
# create a record without owner or TTL).
END_STREAM = lua("end_stream", """
local state = redis.call('HGET', KEYS[1], 'state')
if not state or state == 'cancelled' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'ended')
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
""")

__all__ = ["CLAIM_STREAM", "END_STREAM", "EXPIRE_PARKED", "PARK_STREAM"]
