"""``tokenrelay stats``: each queue's depth, lag, pending jobs by lane, workers, dead
letters, token budget and the job streams no worker reads (``protocol.lanes``), read from what
Redis holds (the CLI prints it; ``demos.service`` shows it live)."""

from __future__ import annotations

import time
from typing import Any

from tokenrelay.producer_sdk.core.queues import DEFAULT_MAX_QUEUED_JOBS
from tokenrelay.producer_sdk.core.queues import LIMIT_FIELD, TOKENS_FIELD
from tokenrelay.protocol.keys import GROUP, Keys
from tokenrelay.protocol.lanes import queue_of_key, unread_lanes


def discover_queues(r: Any, namespace: str) -> list[str]:
    """Queue names of the namespace: those workers serve (``Keys.queues``) and any with a key
    (lanes, dead letters, workers, config); on a cluster the scan covers every master."""
    names = {_s(q) for q in r.smembers(Keys(namespace).queues)}
    for kind in ("jobs", "workers", "config", "dead"):
        for key in r.scan_iter(match=f"{namespace}:{kind}:*", count=1000):
            name = queue_of_key(_s(key)[len(namespace) + len(kind) + 2:])
            if name:
                names.add(name)
    return sorted(names)


def queue_stats(r: Any, keys: Keys, live_s: float) -> dict[str, Any]:
    """Depth, lag and pending by lane, summed over the queue's shards, and its workers."""
    lanes = {name: {"length": 0, "lag": 0, "pending": 0, "consumers": 0} for name in keys.LANES}
    for shard in range(keys.shards):
        for name in keys.LANES:
            info = lane_stats(r, keys.lane(name, shard))
            total = lanes[name]
            for field in ("length", "lag", "pending"):
                total[field] += info[field]
            total["consumers"] = max(total["consumers"], info["consumers"])
    now_ms = int(time.time() * 1000)
    limit, tokens_limit = r.hget(keys.config, LIMIT_FIELD), r.hget(keys.config, TOKENS_FIELD)
    return {
        "queue": keys.queue,
        "shards": keys.shards,
        "depth": sum(li["length"] for li in lanes.values()),
        "lag": sum(li["lag"] for li in lanes.values()),
        "pending": sum(li["pending"] for li in lanes.values()),
        "lanes": lanes,
        "workers_live": r.zcount(keys.workers, now_ms - int(live_s * 1000), "+inf"),
        "workers_known": r.zcard(keys.workers),
        "dead_letters": sum(r.xlen(d) for d in keys.dead_streams()),
        "max_queued_jobs": int(limit) if limit is not None else None,
        "unread_lanes": [{"key": u.key, "depth": u.depth, "reason": u.reason,
                          "detail": u.detail} for u in unread_lanes(r, keys)],
        # the budget counters' sum: the tokens of jobs without a terminal event
        "queued_tokens": sum(int(r.get(b) or 0) for b in keys.budgets()),
        "max_queued_tokens": int(tokens_limit) if tokens_limit is not None else None,
    }


def lane_stats(r: Any, lane: str) -> dict[str, Any]:
    """One lane stream: length, lag (not yet delivered), pending and consumers of the group."""
    info = {"length": r.xlen(lane), "lag": None, "pending": 0, "consumers": 0}
    try:
        groups = r.xinfo_groups(lane)
    except Exception:  # no such stream yet
        groups = []
    for g in groups:
        if _s(g.get("name")) == GROUP:
            info.update(lag=g.get("lag"), pending=g.get("pending", 0),
                        consumers=g.get("consumers", 0))
    if info["lag"] is None:
        # Redis reports no lag after some deletions; acknowledged entries are deleted, so
        # what is in the stream and not pending has not been delivered yet.
        info["lag"] = max(0, info["length"] - info["pending"])
    return info


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def stats_table(stats: list[dict[str, Any]], namespace: str) -> str:
    if not stats:
        return f"no queues in namespace {namespace!r}"
    head = ("queue", "depth", "lag", "pending", "urgent/default/bulk", "workers live/known",
            "dead", "max_queued", "tokens/budget")
    rows = [head]
    for s in stats:
        ln = s["lanes"]
        limit = s["max_queued_jobs"]
        rows.append((s["queue"], str(s["depth"]), str(s["lag"]), str(s["pending"]),
                     f"{ln['urgent']['length']}/{ln['default']['length']}/{ln['bulk']['length']}",
                     f"{s['workers_live']}/{s['workers_known']}", str(s["dead_letters"]),
                     str(limit) if limit is not None else f"{DEFAULT_MAX_QUEUED_JOBS} (default)",
                     f"{s['queued_tokens']}/{s['max_queued_tokens'] or 'none'}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    table = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    for s in stats:
        for u in s["unread_lanes"]:
            table.append(f"UNREAD {s['queue']}: {u['key']} holds {u['depth']} job(s): "
                         f"{u['detail']}")
    return "\n".join(table)
