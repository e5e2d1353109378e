"""Job streams no worker reads, found from what Redis holds: for ``producer_sdk stats``,
``python -m worker admin unread`` and a job's status.

Why: a job stream a queue's workers do not read holds its jobs forever, silently (issue #25:
jobs sent with a guessed shard count sat in a lane no worker reads, with a depth of 0 in stats).
Producers now register the count before they enqueue, but a queue resharded while jobs waited,
or a raw producer that writes another layout's keys, still leaves such streams. Two kinds:

- outside the layout: a job stream of the queue (``<ns>:jobs:{<tag>}...``) whose tag belongs
  to another shard count than the registered one: no worker of this count ever reads it;
- no group yet: a lane of the layout holding jobs that has no consumer group, i.e. no worker
  has read it yet (the first worker creates the group at ``0`` and reads them).

Worker affinity streams of the layout are left out: the affinity sweep empties those of workers
that left (``worker/affinity.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from protocol.keys import GROUP, Keys

OUTSIDE_LAYOUT = "outside_layout"
NO_GROUP = "no_group"


@dataclass(frozen=True)
class UnreadLane:
    """One job stream no worker reads now: its key, how many jobs it holds, and why."""

    key: str
    depth: int
    reason: str         # OUTSIDE_LAYOUT | NO_GROUP
    detail: str


def queue_of_key(rest: str) -> str:
    """The queue a key names after ``<ns>:<kind>:``: ``{<queue>}``, ``{<queue>:<shard>...}``
    (a hash tag) or a plain ``<queue>``."""
    if rest.startswith("{"):
        return rest[1:].split("}", 1)[0].split(":", 1)[0]
    return rest.split(":", 1)[0]


def job_streams(r: Any, keys: Keys) -> Iterator[str]:
    """Every job stream key of ``keys``' queue, whatever its shard layout (a SCAN, on a
    cluster over every master)."""
    prefix = f"{keys.namespace}:jobs:"
    for raw in r.scan_iter(match=f"{prefix}{{{keys.queue}*", count=1000, _type="stream"):
        key = raw.decode() if isinstance(raw, bytes) else str(raw)
        if queue_of_key(key[len(prefix):]) == keys.queue:
            yield key


def unread_lanes(r: Any, keys: Keys) -> list[UnreadLane]:
    """The queue's job streams that hold jobs no worker reads, sorted by key."""
    layout = set(keys.lanes())
    out = []
    for key in sorted(set(job_streams(r, keys))):
        try:
            keys.shard_of_stream(key)
            in_layout = True
        except KeyError:
            in_layout = False
        if in_layout and key not in layout:
            continue                        # an affinity stream of the layout: swept
        depth = int(r.xlen(key))
        if depth == 0:
            continue
        if not in_layout:
            out.append(UnreadLane(key, depth, OUTSIDE_LAYOUT,
                                  f"not a stream of the registered layout ({keys.shards} "
                                  f"shard{'s' if keys.shards > 1 else ''}): no worker reads it"))
        elif not _has_group(r, key):
            out.append(UnreadLane(key, depth, NO_GROUP,
                                  "no consumer group: no worker has read this lane yet"))
    return out


def _has_group(r: Any, key: str) -> bool:
    for g in r.xinfo_groups(key):
        name = g.get("name")
        if (name.decode() if isinstance(name, bytes) else name) == GROUP:
            return True
    return False


__all__ = ["NO_GROUP", "OUTSIDE_LAYOUT", "UnreadLane", "job_streams", "queue_of_key",
           "unread_lanes"]
