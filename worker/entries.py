"""What the worker holds of a job stream: ``Entry``, and the lanes an entry comes from.

The one home of these types, below both modules that use them: ``worker/pending.py`` reads and
moves entries, ``worker/affinity.py`` moves them out of affinity streams and reclaims them, and
each imports this module rather than the other.

Lanes of a queue shard, most urgent first: this worker's own affinity stream (``own_lanes``:
only this worker reads it while it lives, see worker/affinity.py), then the shard's priority
lanes ``urgent``, ``default``, ``bulk`` (``Keys.LANES``). An entry read from any affinity stream,
this worker's or (reclaimed) a dead one's, has the lane name ``affinity``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import redis

from tokenrelay.protocol.budget import entry_cost
from tokenrelay.protocol.keys import COST_FIELD, Keys, PAYLOAD_FIELD

# (lane key, entry id): how an entry is named in every hold-changing call.
EntryKey = tuple[str, str]

AFFINITY_LANE = "affinity"      # the lane name of entries read from an affinity stream

# Lua's unpack() is limited by the C stack (LUAI_MAXCSTACK = 8000); stay far below it.
CHUNK = 500


@dataclass
class Entry:
    """One job stream entry this worker holds (pending under its consumer name)."""

    lane: str                                  # lane name: affinity | urgent | default | bulk
    lane_key: str                              # the stream key
    entry_id: str
    fields: Optional[dict[bytes, bytes]]       # None: the entry was deleted while pending
    deliveries: int = 1
    source: str = "new"                        # new | pending | parked | reclaimed
    shard: int = 0                             # the queue shard of lane_key (its per-job keys)

    @property
    def payload(self) -> Optional[bytes]:
        return None if self.fields is None else self.fields.get(PAYLOAD_FIELD)

    @property
    def cost(self) -> int:
        """The token cost the enqueue admitted (protocol/budget.py); what the job's terminal
        write releases. 0 for an entry without one (a raw producer's)."""
        return 0 if self.fields is None else entry_cost(self.fields.get(COST_FIELD))

    @property
    def key(self) -> EntryKey:
        return self.lane_key, self.entry_id

    @property
    def enqueued_ms(self) -> int:
        """The ms part of an auto-generated id is when the producer's XADD ran."""
        try:
            return int(self.entry_id.split("-", 1)[0])
        except ValueError:
            return 0


def own_lanes(keys: Keys, worker_id: str, shard: int) -> list[tuple[str, str]]:
    """(lane name, key) of this worker's affinity stream on ``shard``: read before the shard's
    shared lanes."""
    return [(AFFINITY_LANE, keys.affinity(worker_id, shard))]


def own_streams(keys: Keys, worker_id: str) -> list[str]:
    """This worker's affinity stream on every shard."""
    return [key for s in range(keys.shards) for _, key in own_lanes(keys, worker_id, s)]


class Lanes:
    """The streams one consumer reads, across every shard of its queue, and how urgent an
    entry of each is.

    Visiting order: this worker's affinity stream of every shard, then the priority lanes most
    urgent first across shards (every shard's urgent lane, then every default lane, ...). A read
    of new entries runs per shard (its streams share the shard's slot), starting from the next
    shard in turn (``shard_order``), so no shard always loses ties."""

    def __init__(self, keys: Keys, worker_id: str) -> None:
        self.keys = keys
        self.worker_id = worker_id
        self.all = [own for s in range(keys.shards) for own in own_lanes(keys, worker_id, s)]
        self.all += [(name, keys.lane(name, s)) for name in keys.LANES
                     for s in range(keys.shards)]
        self._name = {key: name for name, key in self.all}
        # own affinity entries rank first: only this worker reads them (worker/affinity.py)
        self._rank = {name: i for i, name in enumerate((AFFINITY_LANE, *keys.LANES))}
        self.first = 0                     # the shard read first: rotates, see shard_order

    def name(self, lane_key: str) -> str:
        """urgent/default/bulk, or ``affinity`` for an affinity stream (this worker's or, when
        reclaimed, a dead one's: every stream of the queue that is no lane)."""
        return self._name.get(lane_key, AFFINITY_LANE)

    def entry(self, lane_key: str, entry_id: str, fields: Any, deliveries: int,
              source: str) -> Entry:
        """An entry of one of this queue's streams; its shard is that of the stream."""
        return Entry(self.name(lane_key), lane_key, entry_id,
                     entry_fields(fields) if fields else None, int(deliveries or 0), source,
                     self.keys.shard_of_stream(lane_key))

    def urgency(self, e: Entry) -> tuple[int, int, int]:
        """Sort key, most urgent first: lane, then age (older first), then the shard's turn in
        the rotation (no shard always loses ties)."""
        return (self._rank.get(e.lane, self._rank["default"]), e.enqueued_ms,
                (e.shard - self.first) % self.keys.shards)

    def streams(self, shard: int) -> list[str]:
        """The streams one read of ``shard`` names, all in its slot: this worker's affinity
        stream there, then the shard's lanes, urgent first."""
        return [key for _, key in own_lanes(self.keys, self.worker_id, shard)] + \
            self.keys.lanes(shard)

    def shard_order(self) -> list[int]:
        """Every shard once, starting from the next one in turn."""
        n = self.keys.shards
        self.first = (self.first + 1) % n
        return [(self.first + i) % n for i in range(n)]


def entry_fields(raw: Any) -> dict[bytes, bytes]:
    """Entry fields from a script's flat list or redis-py's dict, keys as bytes."""
    pairs = raw.items() if isinstance(raw, dict) else zip(list(raw or [])[0::2],
                                                           list(raw or [])[1::2])
    return {(k if isinstance(k, bytes) else str(k).encode()): v for k, v in pairs}


def is_nogroup(exc: Exception) -> bool:
    """NOGROUP, or Redis 7 unblocking a blocked read because the stream key was deleted."""
    return isinstance(exc, redis.ResponseError) and (
        "NOGROUP" in str(exc) or "no longer exists" in str(exc))


def by_lane(pairs: Iterable[tuple[str, Any]]) -> dict[str, list]:
    """Items grouped by lane key, in order (hold-changing scripts run per lane)."""
    out: dict[str, list] = {}
    for lane, item in pairs:
        out.setdefault(lane, []).append(item)
    return out
