"""The worker id lease: one live process per worker id (consumer name), held through the
``instance`` field of the worker's heartbeat hash (protocol/heartbeat.py; worker/liveness.py
says why).
"""

from __future__ import annotations

from tokenrelay.protocol.scripts.lua import lua

# KEYS: heartbeat hash; ARGV: instance, ttl ms, force -> the instance holding the id now.
ID_CLAIM = lua("id_claim", """
local cur = redis.call('HGET', KEYS[1], '$instance')
if cur and cur ~= ARGV[1] and ARGV[3] ~= '1' then return cur end
redis.call('HSET', KEYS[1], '$instance', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return ARGV[1]
""")

# KEYS: heartbeat hash; ARGV: instance -> 1 when deleted (it was ours).
ID_RELEASE = lua("id_release", """
if redis.call('HGET', KEYS[1], '$instance') == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
""")
