"""The consumer group's pending lists: the one layer that reads, holds and lets go of job entries.

A job stream entry read through the group stays in the pending list of the consumer (worker id)
that read it until it is acknowledged. Its idle time is the lease: a holder renews it well
inside ``lease_ms``, and any worker may reclaim entries idle longer than that, so a generation
running for minutes is never taken from a live worker while the jobs of a crashed or paused one
come back within about one lease period.

Rules kept here (see shared/notes/redis-streams.md): groups are created at ``0`` with MKSTREAM;
NOGROUP recreates them with a loud log; a worker reads only as many entries as it can start;
after (re)connecting it first re-reads its own pending list (ID 0). Both XAUTOCLAIM reply shapes
are handled (Redis 7: ``[cursor, entries, deleted ids]``; 6.2: ``[cursor, entries]``, a deleted
entry coming back with a nil body). Every hold-changing command checks, inside its script, that
the entry is still pending under this worker (protocol/scripts/pending.py).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, Callable, Iterable, Optional

import redis

from tokenrelay.protocol.keys import GROUP, Keys, PARKED_IDLE_MS, PARKING_CONSUMER
from tokenrelay.protocol.scripts import (ACK, DROP_CONSUMER, MOVE_MINE, READ_NEW, READ_OWN_PENDING, RECLAIM,
                              ScriptPipeline, text)
from tokenrelay.protocol.topology import is_cluster
from tokenrelay.worker.entries import CHUNK, Entry, EntryKey, Lanes, by_lane, is_nogroup
from tokenrelay.worker.idle_read import IdleRead
from tokenrelay.worker.connection import RedisClient


class AckStatus(IntEnum):
    """One code per id of an ack."""

    ACKED = 1
    NOT_PENDING = 0      # already acked, or never delivered
    NOT_OWNER = -1       # pending at another consumer: untouched


class PendingList:
    """Reads new entries, re-reads its own, reclaims, renews, parks, releases and acks: every
    operation on the entries of one consumer (``worker_id``) across the priority lanes of every
    shard of the queue.

    A script's keys must share a slot, so reads run per shard (one READ_NEW per shard, all in
    one round trip per node) and hold-changing commands per lane; ``ScriptPipeline`` sends each
    to the node that serves it. Which streams, in which order, and how urgent an entry of each
    is: ``lanes`` (worker/entries.py)."""

    def __init__(self, client: RedisClient, keys: Keys, worker_id: str,
                 on_group_recreated: Optional[Callable[[str], None]] = None) -> None:
        self.client = client
        self.keys = keys
        self.worker_id = worker_id
        self.lanes = Lanes(keys, worker_id)
        self._on_group_recreated = on_group_recreated
        self.arrived: list[Entry] = []      # read (pending here) but not yet taken by intake
        self._idle: Optional[IdleRead] = None
        self._regrouped = False             # a read recreated the groups (see _read_now)

    # ---------------------------------------------------------------- groups
    def ensure_groups(self) -> list[str]:
        """Create the group on every lane at 0 (MKSTREAM); returns the lanes where it was new."""
        created = []
        for _, key in self.lanes.all:
            try:
                self.client.xgroup_create(key, GROUP, id="0", mkstream=True)
                created.append(key)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        return created

    def _recreate_groups(self) -> None:
        for key in self.ensure_groups():
            if self._on_group_recreated:
                self._on_group_recreated(key)

    def _run_all(self, add: Callable[[ScriptPipeline], list[int]]) -> list[Any]:
        """Scripts now, in one round trip per node; on NOGROUP recreate the groups and run them
        all once more (every script here is idempotent). Other error replies are raised."""
        for attempt in (0, 1):
            pipe = ScriptPipeline(self.client)
            idx = add(pipe)
            res = pipe.execute() if len(pipe) else []
            replies = [res[i] for i in idx]
            bad = next((r for r in replies if isinstance(r, Exception)), None)
            if bad is None:
                return replies
            if attempt == 0 and is_nogroup(bad):
                self._recreate_groups()
                continue
            raise bad
        return []

    def _run(self, add: Callable[[ScriptPipeline], int]) -> Any:
        """One script now (NOGROUP: recreate the groups, run it once more)."""
        return self._run_all(lambda p: [add(p)])[0]

    def _rows(self, key: str, rows: Any, source: str) -> list[Entry]:
        """``{id, fields|false, deliveries}`` rows as entries (fields None: deleted)."""
        return [self.lanes.entry(key, text(i), f, d, source) for i, f, d in rows or []]

    # ---------------------------------------------------------------- new entries
    def queue_read_new(self, pipe: ScriptPipeline, count: int) -> Callable[[list], list[Entry]]:
        """Queue a non-blocking read of up to ``count`` entries on EVERY shard (READ_NEW per
        shard: parked hand-backs first, then new entries, urgent lane first), so the loop can
        ride it on its per-step flush; returns the parser of the flush's replies. Together
        the shards may return up to shards x count: the caller keeps the most urgent
        (``urgency``) and hands the rest back (``park``). A reply that failed keeps what the
        other shards read in ``arrived`` before it is raised."""
        queued = [(s, pipe.script(READ_NEW, self.lanes.streams(s),
                                  [GROUP, self.worker_id, int(count), PARKING_CONSUMER]))
                  for s in self.lanes.shard_order()]

        def parse(res: list) -> list[Entry]:
            out: list[Entry] = []
            failed: Optional[Exception] = None
            for s, i in queued:
                if isinstance(res[i], Exception):
                    if is_nogroup(res[i]):
                        self._recreate_groups()
                        self._regrouped = True
                    else:
                        failed = failed or res[i]
                    continue
                lanes = self.lanes.streams(s)
                out += [self.lanes.entry(lanes[int(k) - 1], text(eid), f, d,
                                   "parked" if int(parked) else "new")
                        for k, eid, f, d, parked in res[i] or []]
            if failed is not None:
                self.arrived += out
                raise failed
            return out
        return parse

    def read_new(self, count: int, block_ms: int = 0) -> list[Entry]:
        """Up to ``count`` entries per shard, urgent lane first (see ``queue_read_new``). Blocks
        (up to ``block_ms``) only if every lane is empty; a blocking read takes at most one
        entry per lane."""
        if count <= 0:
            return []
        out = self._read_now(count)
        if out or block_ms <= 0:
            return out
        got = self.wait_new(block_ms)
        if got and len(got) < count:  # woken by a burst: take the rest of it before stepping
            got += self._read_now(count - len(got))
        return got

    def _read_now(self, count: int) -> list[Entry]:
        """Read every shard now; once more when a shard's read found a group missing (e.g. our
        affinity stream, deleted by a sweep that took us for dead): the groups are back, and
        that shard's lanes were not read at all."""
        first = self.lanes.first
        for _ in (0, 1):
            self._regrouped, self.lanes.first = False, first    # the retry reads in the same turn
            pipe = ScriptPipeline(self.client)
            parse = self.queue_read_new(pipe, count)
            out = parse(pipe.execute())
            if out or not self._regrouped:
                break
        return out

    def _idle_read(self) -> IdleRead:
        """One blocking read for every stream (own affinity streams and lanes) on a single
        Redis; one per shard in a cluster."""
        if self._idle is None:
            groups = ([self.lanes.streams(s) for s in range(self.keys.shards)]
                      if is_cluster(self.client) else [[key for _, key in self.lanes.all]])
            self._idle = IdleRead(self.client, groups, GROUP, self.worker_id,
                                  self._recreate_groups)
        return self._idle

    def _arrivals(self, got: list[tuple[str, str, list]]) -> list[Entry]:
        return [self.lanes.entry(lane, eid, f, 1, "new") for lane, eid, f in got]

    def wait_new(self, block_ms: int) -> list[Entry]:
        """Sleep until new entries land (at most ``block_ms``); see worker/idle_read.py."""
        return self._arrivals(self._idle_read().wait(block_ms))

    def take_arrived(self) -> list[Entry]:
        """Entries read but not yet taken: those of a partly failed read, and what blocking
        reads still outstanding since the last wait brought meanwhile."""
        out, self.arrived = self.arrived, []
        if self._idle is not None:
            out += self._arrivals(self._idle.poll())
        return out

    def end_waits(self, timeout_s: float) -> list[Entry]:
        """Wait for outstanding blocking reads to end; everything read and not yet taken."""
        out, self.arrived = self.arrived, []
        if self._idle is not None:
            out += self._arrivals(self._idle.finish(timeout_s))
        return out

    def reset(self) -> None:
        """After a reconnect: drop the blocking reads' connections (their entries, if any,
        come back with the re-read of the own pending list)."""
        if self._idle is not None:
            self._idle.close()
            self._idle = None

    # ---------------------------------------------------------------- own and others' entries
    def read_own_pending(self, page: int = 200) -> list[Entry]:
        """Every entry pending under this consumer, all lanes, urgent first (XREADGROUP ... 0).
        Each such read counts a delivery; see ``restore_counts``."""
        out: list[Entry] = []
        for _, key in self.lanes.all:
            start = "0"
            while True:
                reply = self._run(lambda p: p.script(READ_OWN_PENDING, [key], [
                    GROUP, self.worker_id, start, int(page)]))
                rows = self._rows(key, reply, "pending")
                out += rows
                if len(rows) < page:
                    break
                start = rows[-1].entry_id
        return out

    def reclaim(self, count: int, min_idle_ms: Optional[int],
                streams: Optional[list[str]] = None) -> list[Entry]:
        """Take up to ``count`` entries, most urgent lane first: parked ones (a draining worker's
        hand-backs, delivery count kept), then, when ``min_idle_ms`` is given, entries idle
        longer than that (a dead or stalled holder; one delivery counted). Deleted entries come
        back with ``fields`` None; the caller acks them. ``streams``: other streams than this
        worker's (a dead or draining worker's affinity streams)."""
        out: list[Entry] = []
        for key in [k for _, k in self.lanes.all] if streams is None else streams:
            cursor = "0-0"
            while len(out) < count:
                want = count - len(out)
                nxt, rows, deleted = self._run(lambda p: p.script(RECLAIM, [key], [
                    GROUP, self.worker_id, "" if min_idle_ms is None else int(min_idle_ms),
                    cursor, want, PARKING_CONSUMER]))
                source = "reclaimed" if min_idle_ms is not None else "parked"
                out += self._rows(key, rows, source)
                out += [self.lanes.entry(key, text(i), None, 0, source) for i in deleted or []]
                cursor = text(nxt)
                if cursor == "0-0":
                    break
        return out

    def _move(self, items: Iterable[tuple[str, str, str]], target: str,
              idle_ms: int) -> list[EntryKey]:
        """MOVE_MINE over ``(lane, id, count)``, every lane in one round trip per node; returns
        the (lane, id) no longer ours."""
        calls = [(lane, flat[i:i + CHUNK])
                 for lane, flat in by_lane((lane, (eid, n)) for lane, eid, n in items).items()
                 for i in range(0, len(flat), CHUNK)]
        replies = self._run_all(lambda p: [p.script(MOVE_MINE, [lane], [
            GROUP, self.worker_id, target, int(idle_ms),
            *[x for eid, n in chunk for x in (eid, n)]]) for lane, chunk in calls])
        return [(lane, text(x)) for (lane, _), gone in zip(calls, replies) for x in gone or []]

    def renew(self, held: Iterable[EntryKey]) -> list[EntryKey]:
        """Reset the idle time of held entries (no delivery counted). Returns those no longer
        ours (reclaimed after we stalled, or acked away): drop them, write nothing more."""
        return self._move(((lane, eid, "") for lane, eid in held), self.worker_id, 0)

    def release(self, held: Iterable[EntryKey]) -> list[EntryKey]:
        """Hand entries back counting a delivery: still pending here but idle "forever", so the
        next reclaim anywhere takes them at once, raising the count; for jobs that may have
        broken the engine, so a poison prompt reaches --max-deliveries instead of crash-looping
        the fleet. Returns the entries that were not ours."""
        return self._move(((lane, eid, "") for lane, eid in held), self.worker_id,
                          PARKED_IDLE_MS)

    def park(self, held: Iterable[EntryKey]) -> list[EntryKey]:
        """Hand entries back without counting a delivery (drain, surplus reads): to the parking
        consumer, where the next read of any worker takes them first."""
        return self._move(((lane, eid, "") for lane, eid in held), PARKING_CONSUMER,
                          PARKED_IDLE_MS)

    def queue_park(self, pipe: ScriptPipeline, lane: str, entry_ids: list[str]) -> int:
        """``park`` for one lane, queued on the loop's flush (at most CHUNK ids)."""
        return pipe.script(MOVE_MINE, [lane], [GROUP, self.worker_id, PARKING_CONSUMER,
                                               PARKED_IDLE_MS, *[x for e in entry_ids
                                                                 for x in (e, "")]])

    def restore_counts(self, entries: Iterable[tuple[str, str, int]]) -> list[EntryKey]:
        """Set the delivery count of entries we still hold (and renew them). A re-read of our
        own pending list after a reconnect raises the count of entries we never stopped
        working on; left alone, a few Redis blips would make healthy jobs look like poison."""
        return self._move(((lane, eid, str(max(1, n))) for lane, eid, n in entries),
                          self.worker_id, 0)

    def queue_ack(self, pipe: ScriptPipeline, lane: str, entry_ids: list[str]) -> int:
        """Ack (XACK + XDEL) entries still pending under this worker; the reply is one
        AckStatus per id."""
        return pipe.script(ACK, [lane], [GROUP, self.worker_id, *entry_ids])

    def ack(self, held: Iterable[EntryKey]) -> list[AckStatus]:
        """``queue_ack`` now, for every lane in one round trip per node; the codes in order of
        ``held`` per lane."""
        calls = [(lane, ids[i:i + CHUNK]) for lane, ids in by_lane(held).items()
                 for i in range(0, len(ids), CHUNK)]
        replies = self._run_all(lambda p: [self.queue_ack(p, lane, ids) for lane, ids in calls])
        return [AckStatus(int(c)) for reply in replies for c in reply]

    # ---------------------------------------------------------------- departed consumers
    def drop_departed(self, alive: Callable[[list[str]], list[bool]]) -> list[tuple[str, str]]:
        """Remove departed workers from the group of every shared lane: consumers other than
        this worker and the parking one that hold no pending entry there and whose heartbeat
        is gone (``alive`` answers per name). Why: worker ids accumulate in the groups
        forever otherwise (every restart with a fresh id adds one to every lane). The script
        checks the pending list again in the same step, so a consumer that took an entry
        meanwhile is kept. Returns the (lane, consumer) removed."""
        idle: dict[str, list[str]] = {}
        for key in self.keys.lanes():
            try:
                consumers = self.client.xinfo_consumers(key, GROUP)
            except redis.ResponseError:     # no stream or group yet
                continue
            idle[key] = [name for c in consumers
                         if int(c.get("pending") or 0) == 0
                         and (name := text(c.get("name", b""))) not in (self.worker_id,
                                                                        PARKING_CONSUMER)]
        names = sorted({n for found in idle.values() for n in found})
        if not names:
            return []
        gone = {n for n, live in zip(names, alive(names)) if not live}
        calls = [(lane, n) for lane, found in idle.items() for n in found if n in gone]
        replies = self._run_all(lambda p: [p.script(DROP_CONSUMER, [lane], [GROUP, n])
                                           for lane, n in calls])
        return [call for call, reply in zip(calls, replies) if int(reply) == 1]

    # ---------------------------------------------------------------- metrics
    def lane_stats(self) -> dict[str, tuple[int, int]]:
        """lane name -> (lag, pending) of the group summed over the shards, from XINFO GROUPS
        (lag needs Redis 7). One label per lane name, never per shard: bounded label sets."""
        out: dict[str, tuple[int, int]] = {}
        for name, key in self.lanes.all:
            try:
                groups = self.client.xinfo_groups(key)
            except redis.ResponseError:
                continue
            for g in groups:
                if text(g.get("name", b"")) == GROUP:
                    lag, pending = out.get(name, (0, 0))
                    out[name] = (lag + int(g.get("lag") or 0), pending + int(g.get("pending") or 0))
        return out
