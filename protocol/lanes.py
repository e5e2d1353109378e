"""Job streams no worker reads, found from what Redis holds: for ``producer_sdk stats``,
``tokenrelay admin unread`` and a job's status.

Why: a job stream a queue's workers do not read holds its jobs forever, silently (issue #25:
jobs sent with a guessed shard count sat in a lane no worker reads, with a depth of 0 in stats).
Producers now register the count before they enqueue, but a queue resharded while jobs waited,
or a raw producer that writes another layout's keys, still leaves such streams. Two kinds:

- outside the layout: a lane of the queue's one-shard layout (``<ns>:jobs:{<queue>}``...) while
  the queue is registered with several shards: where producers that guessed the count (before
  they registered it) put their jobs; no worker of the registered count ever reads it;
- no group yet: a lane of the layout holding jobs that has no consumer group, i.e. no worker
  has read it yet (the first worker creates the group at ``0`` and reads them).

Worker affinity streams are left out: the affinity sweep empties those of workers that left
(``worker/affinity.py``). Layouts of other counts (a queue resharded from 3 to 2 shards) are not
looked for: naming them needs SCAN (see ``candidate_streams``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenrelay.protocol.keys import GROUP, Keys

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


def candidate_streams(keys: Keys) -> list[str]:
    """The job streams looked at: the lanes of the registered layout and, for a sharded queue,
    those of the one-shard layout (where producers that guessed the count put their jobs).
    Named, not scanned: the admin and producer ACL rules grant no SCAN (docs/operations.md),
    and SCAN would list other tenants' key names."""
    one = Keys(keys.namespace, keys.queue).lanes() if keys.shards > 1 else []
    return keys.lanes() + one


def unread_lanes(r: Any, keys: Keys) -> list[UnreadLane]:
    """The queue's job streams (``candidate_streams``) that hold jobs no worker reads, sorted
    by key."""
    layout = set(keys.lanes())
    out = []
    for key in sorted(candidate_streams(keys)):
        depth = int(r.xlen(key))
        if depth == 0:
            continue
        if key not in layout:
            out.append(UnreadLane(key, depth, OUTSIDE_LAYOUT,
                                  f"not a stream of the registered layout ({keys.shards} "
                                  f"shards): no worker reads it"))
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


__all__ = ["NO_GROUP", "OUTSIDE_LAYOUT", "UnreadLane", "candidate_streams", "queue_of_key",
           "unread_lanes"]
