"""Reading result streams, as plans: one XREAD BLOCK over many jobs, from each job's last id.

Many jobs share one XREAD (one per cluster slot in a Redis Cluster), so a window of a thousand
jobs costs one connection, not a thousand; each job's ``JobState`` folds what was read for it.
A dropped connection is read again for up to ``reconnect_timeout_s``, from the same ids.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

from producer_sdk._wire import (merge_reads, merge_xreads, normalize_xread, parse_raw_xread,
                                sliced_xread, slot_groups)
from producer_sdk.effects import NET_ERRORS, Call, Plan, Send, Sleep, cluster
from producer_sdk.errors import RedisUnavailable
from producer_sdk.job import Deadline, Delta, JobState, feed_states
from protocol.topology import node_name

XREAD_COUNT = 512


class ResultReader:
    """Reads the result streams of jobs for one client: ``poll_ms`` is the longest block,
    ``reconnect_timeout_s`` how long a lost connection is tried again."""

    def __init__(self, poll_ms: int, reconnect_timeout_s: float, url: str) -> None:
        self.poll_ms = poll_ms
        self.reconnect_timeout_s = reconnect_timeout_s
        self.url = url

    def pump(self, states: Iterable[JobState],
             block_ms: int) -> Plan[list[tuple[JobState, list[Delta]]]]:
        """One XREAD over several jobs; feeds each job the entries read for it."""
        by_key = {s.key: s for s in states if not s.finished}
        if not by_key:
            return []
        read = yield from self.read({k: s.last_id for k, s in by_key.items()}, block_ms)
        return feed_states(by_key, read, XREAD_COUNT)

    def pump_one(self, state: JobState, deadline: Deadline) -> Plan[list[Delta]]:
        got = yield from self.pump([state], deadline.block_ms(self.poll_ms))
        return got[0][1] if got else []

    def read(self, streams: dict[str, bytes], block_ms: int) -> Plan[list]:
        """XREAD BLOCK that survives dropped connections for up to ``reconnect_timeout_s``."""
        give_up = time.monotonic() + self.reconnect_timeout_s
        pause = 0.05
        while True:
            try:
                return (yield from read_once(streams, block_ms))
            except NET_ERRORS as exc:
                if time.monotonic() >= give_up:
                    raise RedisUnavailable(self.url, exc) from exc
                yield Sleep(pause)
                pause = min(pause * 2, 1.0)


def read_once(streams: dict[str, bytes], block_ms: int) -> Plan[list]:
    """One stream: a plain XREAD. Several in one slot (or on one Redis): the blocking XREAD and
    the non-blocking one pipelined behind it (``_wire.merge_xreads`` says why). Several slots
    of a cluster: rounds of sliced reads (``_wire.sliced_xread``) until something came or the
    wait is over."""
    if len(streams) == 1:
        return normalize_xread((yield Call(
            lambda r: r.xread(streams, count=XREAD_COUNT, block=block_ms))))
    if not (yield cluster()) or len(slot_groups(streams)) == 1:
        return merge_xreads(*(yield Call(lambda r: _xread_pair(r, streams, block_ms))))
    end = time.monotonic() + block_ms / 1000
    while True:
        items = yield Call(lambda r: sliced_xread(streams, lambda k: node_name(r, k),
                                                  XREAD_COUNT, block_ms))
        replies, _ = yield Send(items)
        got = merge_reads(parse_raw_xread(x) for x in replies)
        left_ms = int((end - time.monotonic()) * 1000)
        if got or left_ms <= 0:
            return got
        block_ms = left_ms


def _xread_pair(r: Any, streams: dict[str, bytes], block_ms: int) -> Any:
    pipe = r.pipeline(transaction=False)
    pipe.xread(streams, count=XREAD_COUNT, block=block_ms)
    pipe.xread(streams, count=XREAD_COUNT)
    return pipe.execute()


__all__ = ["ResultReader", "read_once", "XREAD_COUNT"]
