"""Cluster clients that route stream reads by their keys' slot, computed here, never asked of a node.

redis-py finds the keys of a command with "movable keys" (XREAD, XREADGROUP) by sending
``COMMAND GETKEYS`` to one node, the node its commands parser was made with. When that node is
the master that just died, every XREAD fails with ConnectionError until the caller's retry
bound runs out, although the cluster promoted a replica seconds ago: the retry refreshes the slot
map, not that node (issue #42: 12 of 25 failovers broke gateway streams, also on shards whose
master never died). A stream read's keys are its arguments after ``STREAMS`` (the first half;
the second half is their ids), so the slot is known without any round trip, as the server
computes it (CRC16 of the hash tag). Every other command keeps redis-py's routing.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import RedisClusterException

STREAM_READS = frozenset({"XREAD", "XREADGROUP"})


def _text(word: Any) -> str:
    return word.decode() if isinstance(word, (bytes, bytearray)) else str(word)


def stream_read_keys(args: Sequence[Any]) -> list[Any]:
    """The stream keys of an ``XREAD``/``XREADGROUP`` command line (its name excluded)."""
    upper = [_text(a).upper() if isinstance(a, (str, bytes, bytearray)) else "" for a in args]
    if "STREAMS" not in upper:
        raise RedisClusterException(f"a stream read without STREAMS: {list(args)[:8]}")
    rest = list(args)[upper.index("STREAMS") + 1:]
    if not rest or len(rest) % 2:
        raise RedisClusterException("a stream read needs as many ids as keys after STREAMS")
    return rest[:len(rest) // 2]


def local_slot(command: Any, args: Sequence[Any]) -> Optional[int]:
    """The slot of a stream read from its own keys (None for any other command). Keys of several
    slots are the caller's error, as the server would answer CROSSSLOT."""
    if _text(command).upper() not in STREAM_READS:
        return None
    slots = {key_slot(k.encode() if isinstance(k, str) else bytes(k)) for k in stream_read_keys(args)}
    if len(slots) != 1:
        raise RedisClusterException(f"a stream read's keys span {len(slots)} slots (CROSSSLOT)")
    return slots.pop()


class SlotRoutedCluster(RedisCluster):
    """redis-py's RedisCluster; stream reads routed by ``local_slot``."""

    def determine_slot(self, *args: Any) -> Optional[int]:
        slot = local_slot(args[0], args[1:]) if args else None
        return super().determine_slot(*args) if slot is None else slot


class AsyncSlotRoutedCluster(AsyncRedisCluster):
    """redis-py's asyncio RedisCluster (pipelines included); stream reads routed by ``local_slot``."""

    async def _determine_slot(self, command: str, *args: Any) -> int:
        slot = local_slot(command, args)
        return await super()._determine_slot(command, *args) if slot is None else slot
