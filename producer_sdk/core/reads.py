"""Reading result streams, as plans: one XREAD BLOCK over many jobs, from each job's last id.

Many jobs share one XREAD (one per cluster slot in a Redis Cluster), so a window of a thousand
jobs costs one connection, not a thousand; each job's ``JobState`` folds what was read for it.
A read cut by a lost connection or a cluster failing a master over (CLUSTERDOWN, TRYAGAIN,
MOVED) is sent again for up to ``reconnect_timeout_s``, from the same ids.

A reader also keeps what it waits for honest without any worker's help:

* **Deadlines.** A job whose start deadline passed (plus ``deadline_grace_s``) with no worker
  having started it is the reader's to end: ``overdue`` names them, the client cancels them (no
  worker runs them later) and they end ``expired``, whether or not any worker lives.
* **Lost jobs.** A job idle for ``lost_check_s`` has its records checked (``check_lost``, for
  all of them in one or two pipelines): not finished, with its dedupe record gone or naming an
  entry its lane no longer holds (a Redis restarted without its data, a failover that lost the
  enqueue), no worker will ever run it. The client puts it back in its queue when it holds
  the request (``rerun_request``; a stale record a worker wrote again after the restart is let
  go first, ``FORGET_STALE_RECORD``), else ends it ``job_lost``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import msgpack

from tokenrelay.producer_sdk.core.effects import Call, Plan, Send, cluster, raise_transient, retrying
from tokenrelay.producer_sdk.jobs.job import Delta, JobState, feed_states
from tokenrelay.protocol.errors import ProtocolError
from tokenrelay.protocol.keys import EVENT_FIELD, key_slot, parse_dedupe_record
from tokenrelay.protocol.scripts import pack
from tokenrelay.protocol.topology import Packed, node_name
from tokenrelay.protocol.wire import decode_event

XREAD_COUNT = 512

Pumped = list[tuple[JobState, list[Delta]]]


class ResultReader:
    """Reads the result streams of jobs for one client: ``poll_ms`` is the longest block,
    ``reconnect_timeout_s`` how long a failed read is tried again, ``lost_check_s`` how long a
    job may be idle before its records are checked, ``deadline_grace_s`` how long after a start
    deadline a worker's own ``expired`` event is waited for."""

    def __init__(self, poll_ms: int, reconnect_timeout_s: float, url: str,
                 lost_check_s: float = 2.0, deadline_grace_s: float = 0.5) -> None:
        self.poll_ms = poll_ms
        self.reconnect_timeout_s = reconnect_timeout_s
        self.url = url
        self.lost_check_s = lost_check_s
        self.grace_ms = deadline_grace_s * 1000

    def pump(self, states: Iterable[JobState], block_ms: int,
             extra: Optional[dict[str, bytes]] = None) -> Plan[Pumped]:
        """One XREAD over several jobs (and the ``extra`` streams, whose last ids it advances in
        place); feeds each job the entries read for it. The block is cut short to wake when a
        job falls due (``wait_ms``)."""
        by_key = {s.key: s for s in states if not s.finished}
        if not by_key:
            return []
        streams = {k: s.last_id for k, s in by_key.items()}
        if extra:
            streams.update(extra)
        read = yield from self.read(streams, self.wait_ms(by_key.values(), block_ms))
        mine = []
        for key, entries in read:
            if key in by_key:
                mine.append((key, entries))
            elif extra is not None and key in extra and entries:
                extra[key] = _entry_id(entries[-1][0])
        return feed_states(by_key, mine, XREAD_COUNT)

    def read(self, streams: dict[str, bytes], block_ms: int) -> Plan[list]:
        """XREAD BLOCK that survives lost connections and failovers (``effects.retrying``)."""
        return (yield from retrying(lambda: read_once(streams, block_ms),
                                    self.reconnect_timeout_s, self.url))

    # -- what a reader decides by itself
    def wait_ms(self, states: Iterable[JobState], block_ms: int) -> int:
        """``block_ms``, cut to wake when the first job falls due: its start deadline (plus the
        grace) or its next records check."""
        now_ms, mono = time.time() * 1000, time.monotonic()
        wait = float(block_ms)
        for s in states:
            if s.start_deadline_ms is not None and not s.started:
                wait = min(wait, s.start_deadline_ms + self.grace_ms - now_ms + 5)
            due = max(s.seen_at, s.checked_at) + self.lost_check_s
            wait = min(wait, (due - mono) * 1000 + 5)
        return max(1, int(wait))

    def overdue(self, states: Iterable[JobState]) -> list[JobState]:
        """Jobs no worker started by their deadline (plus the grace)."""
        now_ms = time.time() * 1000
        return [s for s in states if s.overdue(now_ms, self.grace_ms)]

    def loss_due(self, states: Iterable[JobState]) -> list[JobState]:
        """Jobs idle (no entry read, no check) for ``lost_check_s``: their records are due for
        a check."""
        now = time.monotonic()
        return [s for s in states if not s.finished and s.dedupe_key is not None
                and now - max(s.seen_at, s.checked_at) >= self.lost_check_s]

    def check_lost(self, states: Sequence[JobState]) -> Plan[list[Lost]]:
        """The jobs of ``states`` that no one will ever run or write to: not finished, and
        their dedupe record is gone, or names an entry its lane no longer holds (workers delete
        an entry only after its job's terminal event). Two pipelined round trips at most
        (routed per key on a cluster), retried like a read: each job's record and last event,
        then, for a record and no terminal event, whether the record's entry is still there."""
        if not states:
            return []

        def heads(r: Any) -> Any:
            pipe = r.pipeline(transaction=False)
            for s in states:
                pipe.get(s.dedupe_key)
                pipe.xrevrange(s.key, count=1)
            return pipe.execute(False)

        def check() -> Plan[list[Lost]]:
            replies = list(raise_transient((yield Call(heads))))
            suspects = []
            for i, s in enumerate(states):
                record, last = replies[2 * i], replies[2 * i + 1]
                if _terminal(last):
                    continue
                if record is None:      # with a stream: a job a raw producer sent, or older
                    if not last:        # than its record's TTL; neither: lost
                        suspects.append(Lost(s, None, None, None))
                    continue
                try:
                    lane, entry = parse_dedupe_record(record)
                except ProtocolError:
                    continue
                suspects.append(Lost(s, record, lane, entry))
            known = [x for x in suspects if x.record is not None]
            if known:
                def entries(r: Any) -> Any:     # the entry, then (later) the last event
                    pipe = r.pipeline(transaction=False)
                    for x in known:
                        pipe.xrange(x.lane, x.entry, x.entry, count=1)
                        pipe.xrevrange(x.state.key, count=1)
                    return pipe.execute(False)
                there = list(raise_transient((yield Call(entries))))
                # an entry is deleted only after its job's terminal event is written: gone
                # with a terminal event read after it is a job that just ended
                held = {id(x) for i, x in enumerate(known)
                        if there[2 * i] or _terminal(there[2 * i + 1])}
                suspects = [x for x in suspects if id(x) not in held]
            return suspects

        lost = yield from retrying(check, self.reconnect_timeout_s, self.url)
        now = time.monotonic()
        for s in states:
            s.checked_at = now
        return [x for x in lost if not x.state.finished]


@dataclass(frozen=True)
class Lost:
    """A job no one will run: its state, and the stale dedupe record that still names it
    (None when the record is gone too): its value, lane and entry id."""

    state: JobState
    record: Optional[bytes]
    lane: Optional[str]
    entry: Optional[str]


def _terminal(last: Any) -> bool:
    """Whether an ``XREVRANGE .. COUNT 1`` reply is a terminal event (``done`` / ``error``)."""
    if not isinstance(last, list) or not last:
        return False
    try:
        return decode_event(fields_dict(last[0][1])[EVENT_FIELD]).type in ("done", "error")
    except (ProtocolError, KeyError, IndexError, TypeError):
        return False


def rerun_request(request: Any, seed: Optional[int]) -> Any:
    """The request to enqueue again for a job Redis lost: the same payload, with the seed its
    first worker drew (``started``) when it had none, so the rerun makes the tokens the reader
    already has and the fold, which skips them by ``seq``, continues exactly where it was."""
    if seed is None:
        return request
    payload = msgpack.unpackb(request.payload, raw=False)
    params = payload.setdefault("params", {})
    if "seed" in params or params.get("beam_width") is not None:
        return request
    params["seed"] = seed
    return replace(request, payload=msgpack.packb(payload, use_bin_type=True))


def _entry_id(entry_id: Any) -> bytes:
    return entry_id if isinstance(entry_id, bytes) else str(entry_id).encode()


def read_once(streams: dict[str, bytes], block_ms: int) -> Plan[list]:
    """One stream: a plain XREAD. Several in one slot (or on one Redis): the blocking XREAD and
    the non-blocking one pipelined behind it (``merge_xreads`` says why). Several slots
    of a cluster: rounds of sliced reads (``sliced_xread``) until something came or the
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


# -- the XREAD commands and replies
def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def normalize_xread(reply: Any) -> list[tuple[str, list[tuple[bytes, dict]]]]:
    """XREAD replies as [(key, [(entry id, fields)])] for both RESP2 and RESP3 shapes."""
    if not reply:
        return []
    if isinstance(reply, dict):
        out = []
        for key, entries in reply.items():
            if entries and isinstance(entries[0], list) and entries[0] and isinstance(
                    entries[0][0], (tuple, list)):
                entries = entries[0]
            out.append((_s(key), list(entries)))
        return out
    return [(_s(key), list(entries)) for key, entries in reply]


def merge_xreads(blocking: Any, follow_up: Any) -> list[tuple[str, list[tuple[bytes, dict]]]]:
    """One answer from a blocking multi-stream XREAD and the non-blocking XREAD for the same ids
    pipelined right behind it.

    Why the pair: before Redis 7.2 a blocked multi-stream XREAD is answered with only the first
    stream that got data, although a worker writes all its jobs' streams in one step; the
    follow-up runs the moment the blocking read is answered and brings the others, without a
    client round trip. Both start from the same ids, so per stream the longer list wins."""
    return merge_reads([normalize_xread(blocking), normalize_xread(follow_up)])


def merge_reads(reads: Iterable[list[tuple[str, list]]]) -> list[tuple[str, list]]:
    """Several normalized XREAD answers as one; per stream the longest list wins (reads of one
    stream start from the same id)."""
    merged: dict[str, list] = {}
    for read in reads:
        for key, entries in read:
            if len(entries) > len(merged.get(key, ())):
                merged[key] = entries
    return list(merged.items())


# A read of result streams in several cluster slots blocks on one slot per node at a time, so
# it blocks in slices this long and then reads every slot again: an event of another slot waits
# at most one slice. (One slot, or one Redis, blocks for the whole wait.)
XREAD_SLICE_MS = 50


def xread_command(streams: Mapping[str, bytes], keys: Sequence[str], count: int,
                  block_ms: Optional[int]) -> bytes:
    """A packed XREAD of ``keys`` from their last ids in ``streams``."""
    head = [b"XREAD", b"COUNT", b"%d" % count]
    if block_ms is not None:
        head += [b"BLOCK", b"%d" % block_ms]
    return pack([*head, b"STREAMS", *[k.encode() for k in keys],
                         *[streams[k] for k in keys]])


def slot_groups(keys: Iterable[str]) -> list[list[str]]:
    """Stream keys grouped by cluster slot (a cluster refuses a multi-key XREAD across slots);
    per-job keys of one queue shard share its hash tag, so a window of many jobs is one group
    per shard."""
    groups: dict[int, list[str]] = {}
    for k in keys:
        groups.setdefault(key_slot(k), []).append(k)
    return list(groups.values())


def sliced_xread(streams: Mapping[str, bytes], node_of: Callable[[str], Any], count: int,
                 block_ms: int) -> list[Packed]:
    """One round of reading streams spread over several slots: per node, a blocking XREAD of
    its first slot group (for at most one slice) and the non-blocking XREAD of every group of
    it behind it (the first one again too: see ``merge_xreads``)."""
    out: list[Packed] = []
    blocking: set[Any] = set()
    for group in slot_groups(streams):
        node = node_of(group[0])
        cmds = [xread_command(streams, group, count, None)]
        if node not in blocking:
            blocking.add(node)
            cmds.insert(0, xread_command(streams, group, count, min(block_ms, XREAD_SLICE_MS)))
        out.append((group[0], b"".join(cmds), len(cmds)))
    return out


def parse_raw_xread(reply: Any) -> list[tuple[str, list[tuple[bytes, dict]]]]:
    """A raw XREAD reply (RESP2 list or RESP3 map, fields as a flat list, as a connection
    returns it without redis-py's callbacks) as ``normalize_xread`` gives it."""
    if isinstance(reply, Exception):
        raise reply
    if not reply:
        return []
    pairs = reply.items() if isinstance(reply, dict) else reply
    out = []
    for key, entries in pairs:
        out.append((_s(key), [(eid, fields_dict(raw)) for eid, raw in entries or ()]))
    return out


def fields_dict(raw: Any) -> dict:
    """A stream entry's fields as a dict, from redis-py's dict or the raw flat list (a reply
    read without redis-py's callbacks, as a cluster MULTI returns them too)."""
    if isinstance(raw, dict):
        return raw
    raw = raw or []
    return {raw[i]: raw[i + 1] for i in range(0, len(raw) - 1, 2)}


__all__ = ["ResultReader", "Lost", "read_once", "rerun_request", "XREAD_COUNT", "Pumped",
           "normalize_xread", "merge_xreads", "merge_reads", "xread_command", "slot_groups",
           "sliced_xread", "parse_raw_xread", "fields_dict", "XREAD_SLICE_MS"]
