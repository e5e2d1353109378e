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
the entry is still pending under this worker (worker/scripts.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Callable, Iterable, Optional

import redis

from producer_sdk.protocol import GROUP, PARKED_IDLE_MS, PARKING_CONSUMER, PAYLOAD_FIELD, Keys
from worker.affinity import own_lanes
from worker.scripts import (ACK, MOVE_MINE, READ_NEW, READ_OWN_PENDING, RECLAIM, ScriptPipeline,
                            text)

# Lua's unpack() is limited by the C stack (LUAI_MAXCSTACK = 8000); stay far below it.
CHUNK = 500


@dataclass
class Entry:
    """One job stream entry this worker holds (pending under its consumer name)."""

    lane: str                                  # lane name: urgent | default | bulk
    lane_key: str                              # the stream key
    entry_id: str
    fields: Optional[dict[bytes, bytes]]       # None: the entry was deleted while pending
    deliveries: int = 1
    source: str = "new"                        # new | pending | parked | reclaimed

    @property
    def payload(self) -> Optional[bytes]:
        return None if self.fields is None else self.fields.get(PAYLOAD_FIELD)

    @property
    def key(self) -> tuple[str, str]:
        return self.lane_key, self.entry_id

    @property
    def enqueued_ms(self) -> int:
        """The ms part of an auto-generated id is when the producer's XADD ran."""
        try:
            return int(self.entry_id.split("-", 1)[0])
        except ValueError:
            return 0


class AckStatus(IntEnum):
    """One code per id of an ack."""

    ACKED = 1
    NOT_PENDING = 0      # already acked, or never delivered
    NOT_OWNER = -1       # pending at another consumer: untouched


def _fields(raw: Any) -> dict[bytes, bytes]:
    """Entry fields from a script's flat list or redis-py's dict, keys as bytes."""
    pairs = raw.items() if isinstance(raw, dict) else zip(list(raw or [])[0::2],
                                                           list(raw or [])[1::2])
    return {(k if isinstance(k, bytes) else str(k).encode()): v for k, v in pairs}


def is_nogroup(exc: Exception) -> bool:
    """NOGROUP, or Redis 7 unblocking a blocked read because the stream key was deleted."""
    return isinstance(exc, redis.ResponseError) and (
        "NOGROUP" in str(exc) or "no longer exists" in str(exc))


def by_lane(pairs: Iterable[tuple[str, Any]]) -> dict[str, list]:
    out: dict[str, list] = {}
    for lane, item in pairs:
        out.setdefault(lane, []).append(item)
    return out


class PendingList:
    """Reads new entries, re-reads its own, reclaims, renews, parks, releases and acks: every
    operation on the entries of one consumer (``worker_id``) across the priority lanes."""

    def __init__(self, client: redis.Redis, keys: Keys, worker_id: str,
                 on_group_recreated: Optional[Callable[[str], None]] = None) -> None:
        self.client = client
        self.keys = keys
        self.worker_id = worker_id
        # This worker's affinity stream first (worker/affinity.py says why), then the lanes.
        self._lanes = own_lanes(keys, worker_id, 0) + [(name, keys.lane(name))
                                                       for name in keys.LANES]
        self._lane_name = {key: name for name, key in self._lanes}
        self._on_group_recreated = on_group_recreated

    def lane_name(self, lane_key: str) -> str:
        return self._lane_name.get(lane_key, "default")

    # ---------------------------------------------------------------- groups
    def ensure_groups(self) -> list[str]:
        """Create the group on every lane at 0 (MKSTREAM); returns the lanes where it was new."""
        created = []
        for _, key in self._lanes:
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

    def _run(self, add: Callable[[ScriptPipeline], int]) -> Any:
        """One script now; on NOGROUP recreate the groups and run it once more."""
        for attempt in (0, 1):
            pipe = ScriptPipeline(self.client)
            add(pipe)
            reply = pipe.execute()[0]
            if isinstance(reply, Exception):
                if attempt == 0 and is_nogroup(reply):
                    self._recreate_groups()
                    continue
                raise reply
            return reply
        return []

    def _rows(self, name: str, key: str, rows: Any, source: str) -> list[Entry]:
        """``{id, fields|false, deliveries}`` rows as entries (fields None: deleted)."""
        return [Entry(name, key, text(i), _fields(f) if f else None, int(d or 0), source)
                for i, f, d in rows or []]

    # ---------------------------------------------------------------- new entries
    def queue_read_new(self, pipe: ScriptPipeline, count: int) -> int:
        """Queue a non-blocking read of up to ``count`` new entries (urgent first), so the loop
        can ride it on its per-step flush; parse the reply with ``new_entries``."""
        return pipe.script(READ_NEW, [key for _, key in self._lanes],
                           [GROUP, self.worker_id, int(count)])

    def new_entries(self, reply: Any) -> list[Entry]:
        """Entries of a READ_NEW reply; a NOGROUP reply recreates the groups (none read)."""
        if isinstance(reply, Exception):
            if not is_nogroup(reply):
                raise reply
            self._recreate_groups()
            return []
        return [Entry(*self._lanes[int(i) - 1], text(eid), _fields(f), 1, "new")
                for i, eid, f in reply or []]

    def read_new(self, count: int, block_ms: int = 0) -> list[Entry]:
        """Up to ``count`` new entries, urgent lane first. Blocks (up to ``block_ms``) only if
        every lane is empty; a blocking read takes at most one entry per lane."""
        if count <= 0:
            return []
        out = self.new_entries(self._run(lambda p: self.queue_read_new(p, count)))
        if out or block_ms <= 0:
            return out
        got = self._blocking_read(block_ms)
        if got and len(got) < count:  # woken by a burst: take the rest of it before stepping
            got += self.read_new(count - len(got), 0)
        return got

    def _blocking_read(self, block_ms: int) -> list[Entry]:
        streams = {key: ">" for _, key in self._lanes}
        try:
            reply = self.client.xreadgroup(GROUP, self.worker_id, streams, count=1,
                                           block=block_ms)
        except redis.ResponseError as exc:
            if not is_nogroup(exc):
                raise
            self._recreate_groups()
            return []
        pairs = reply.items() if isinstance(reply, dict) else (reply or [])
        found = {text(stream): entries for stream, entries in pairs}
        return [Entry(name, key, text(eid), _fields(f), 1, "new")
                for name, key in self._lanes for eid, f in found.get(key, []) if eid is not None]

    # ---------------------------------------------------------------- own and others' entries
    def read_own_pending(self, page: int = 200) -> list[Entry]:
        """Every entry pending under this consumer, all lanes, urgent first (XREADGROUP ... 0).
        Each such read counts a delivery; see ``restore_counts``."""
        out: list[Entry] = []
        for name, key in self._lanes:
            start = "0"
            while True:
                reply = self._run(lambda p: p.script(READ_OWN_PENDING, [key], [
                    GROUP, self.worker_id, start, int(page)]))
                rows = self._rows(name, key, reply, "pending")
                out += rows
                if len(rows) < page:
                    break
                start = rows[-1].entry_id
        return out

    def reclaim(self, count: int, min_idle_ms: Optional[int],
                lanes: Optional[list[tuple[str, str]]] = None) -> list[Entry]:
        """Take up to ``count`` entries, most urgent lane first: parked ones (a draining worker's
        hand-backs, delivery count kept), then, when ``min_idle_ms`` is given, entries idle
        longer than that (a dead or stalled holder; one delivery counted). Deleted entries come
        back with ``fields`` None; the caller acks them. ``lanes``: (name, key) of other
        streams than this worker's lanes (another worker's affinity stream)."""
        out: list[Entry] = []
        for name, key in self._lanes if lanes is None else lanes:
            cursor = "0-0"
            while len(out) < count:
                want = count - len(out)
                nxt, rows, deleted = self._run(lambda p: p.script(RECLAIM, [key], [
                    GROUP, self.worker_id, "" if min_idle_ms is None else int(min_idle_ms),
                    cursor, want, PARKING_CONSUMER]))
                source = "reclaimed" if min_idle_ms is not None else "parked"
                out += self._rows(name, key, rows, source)
                out += [Entry(name, key, text(i), None, 0, source) for i in deleted or []]
                cursor = text(nxt)
                if cursor == "0-0":
                    break
        return out

    def _move(self, items: Iterable[tuple[str, str, str]], target: str,
              idle_ms: int) -> list[tuple[str, str]]:
        """MOVE_MINE over ``(lane, id, count)``; returns the (lane, id) no longer ours."""
        lost: list[tuple[str, str]] = []
        for lane, flat in by_lane((lane, (eid, n)) for lane, eid, n in items).items():
            for i in range(0, len(flat), CHUNK):
                args = [x for eid, n in flat[i:i + CHUNK] for x in (eid, n)]
                gone = self._run(lambda p: p.script(MOVE_MINE, [lane], [
                    GROUP, self.worker_id, target, int(idle_ms), *args]))
                lost += [(lane, text(x)) for x in gone or []]
        return lost

    def renew(self, held: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        """Reset the idle time of held entries (no delivery counted). Returns those no longer
        ours (reclaimed after we stalled, or acked away): drop them, write nothing more."""
        return self._move(((lane, eid, "") for lane, eid in held), self.worker_id, 0)

    def release(self, held: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        """Hand entries back counting a delivery: still pending here but idle "forever", so the
        next reclaim anywhere takes them at once, raising the count; for jobs that may have
        broken the engine, so a poison prompt reaches --max-deliveries instead of crash-looping
        the fleet. Returns the entries that were not ours."""
        return self._move(((lane, eid, "") for lane, eid in held), self.worker_id,
                          PARKED_IDLE_MS)

    def park(self, held: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        """Hand entries back without counting a delivery (drain): to the parking consumer."""
        return self._move(((lane, eid, "") for lane, eid in held), PARKING_CONSUMER,
                          PARKED_IDLE_MS)

    def queue_park(self, pipe: ScriptPipeline, lane: str, entry_ids: list[str]) -> int:
        """``park`` for one lane, queued on the loop's flush (at most CHUNK ids)."""
        return pipe.script(MOVE_MINE, [lane], [GROUP, self.worker_id, PARKING_CONSUMER,
                                               PARKED_IDLE_MS, *[x for e in entry_ids
                                                                 for x in (e, "")]])

    def restore_counts(self, entries: Iterable[tuple[str, str, int]]) -> list[tuple[str, str]]:
        """Set the delivery count of entries we still hold (and renew them). A re-read of our
        own pending list after a reconnect raises the count of entries we never stopped
        working on; left alone, a few Redis blips would make healthy jobs look like poison."""
        return self._move(((lane, eid, str(max(1, n))) for lane, eid, n in entries),
                          self.worker_id, 0)

    def queue_ack(self, pipe: ScriptPipeline, lane: str, entry_ids: list[str]) -> int:
        """Ack (XACK + XDEL) entries still pending under this worker; the reply is one
        AckStatus per id."""
        return pipe.script(ACK, [lane], [GROUP, self.worker_id, *entry_ids])

    def ack(self, held: Iterable[tuple[str, str]]) -> list[AckStatus]:
        """``queue_ack`` now, for every lane; the codes in order of ``held`` per lane."""
        codes: list[AckStatus] = []
        for lane, ids in by_lane(held).items():
            for i in range(0, len(ids), CHUNK):
                codes += [AckStatus(int(c)) for c in self._run(
                    lambda p: self.queue_ack(p, lane, ids[i:i + CHUNK]))]
        return codes

    # ---------------------------------------------------------------- metrics
    def lane_stats(self) -> dict[str, tuple[int, int]]:
        """lane name -> (lag, pending) of the group, from XINFO GROUPS (lag needs Redis 7)."""
        out = {}
        for name, key in self._lanes:
            try:
                groups = self.client.xinfo_groups(key)
            except redis.ResponseError:
                continue
            for g in groups:
                if text(g.get("name", b"")) == GROUP:
                    out[name] = (int(g.get("lag") or 0), int(g.get("pending") or 0))
        return out
