"""How many shards a queue has: registered once by its workers in the queue's config hash
(field ``shards``), read by producers, admin and health commands.

The count is part of every key's name (``Keys.tag``), so every process of a queue must agree on
it: a worker started with another ``--shards`` than the queue registered refuses to start, and a
producer without ``shards=`` uses the registered count. Changing it means draining the queue
first (docs/protocol.md, "Shards").
"""

from __future__ import annotations

from typing import Any, Optional

from tokenrelay.protocol.keys import Keys, MAX_SHARDS

SHARDS_FIELD = "shards"


class ShardCountMismatch(RuntimeError):
    """A process was told another shard count than the queue registered."""


def parse_shards(raw: Any, where: str) -> Optional[int]:
    """The ``shards`` field's value (None when absent); ShardCountMismatch when it holds no
    count from 1 to MAX_SHARDS (``where`` names the hash in the message)."""
    if raw is None:
        return None
    text = raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw)
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_SHARDS:
        raise ShardCountMismatch(f"{where} holds shards={text!r}, not a count from 1 to "
                                 f"{MAX_SHARDS}; fix it with HSET {where} {SHARDS_FIELD} <n>")
    return n


def mismatch(keys: Keys, given: int, registered: int) -> ShardCountMismatch:
    return ShardCountMismatch(
        f"queue {keys.queue!r} is registered with {registered} shards ({keys.config}) but "
        f"{given} were asked for; drop --shards to use {registered}, or drain the queue and "
        f"delete that field to reshard")


def registered_shards(client: Any, keys: Keys) -> Optional[int]:
    """The count the queue's workers registered, None when none did yet."""
    return parse_shards(client.hget(keys.config, SHARDS_FIELD), keys.config)


def resolve_shards(given: Optional[int], registered: Optional[int], keys: Keys) -> int:
    """The count to use: the registered one; ``given`` must match it when both are known."""
    if registered is not None and given is not None and given != registered:
        raise mismatch(keys, given, registered)
    return registered or given or 1


def register_shards(client: Any, keys: Keys, given: Optional[int]) -> int:
    """For a worker: register ``given`` (None: 1) unless a count is registered already
    (HSETNX: the first worker decides), then return the count every process must use;
    ShardCountMismatch when ``given`` differs from what is registered."""
    client.hsetnx(keys.config, SHARDS_FIELD, given or 1)
    return resolve_shards(given, registered_shards(client, keys), keys)
