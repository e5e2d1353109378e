"""Reading jobs: consumer groups over the priority lanes, most urgent first.

Rules kept here (see shared/notes/redis-streams.md): groups are created at ``0`` with MKSTREAM;
a NOGROUP reply recreates them with a loud log; the worker reads only as many entries as the
engine can start soon (the caller passes ``count``), so jobs never wait in this worker's pending
list while another worker idles; after (re)connecting it first re-reads its own pending entries
(ID 0), which may hold entries a broken blocking read delivered but never returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import redis

from producer_sdk.protocol import GROUP, PAYLOAD_FIELD, Keys
from worker.fencing import Fence, ScriptPipeline, fields_of, parse_raw_entries


@dataclass
class Entry:
    """One job stream entry held by this worker."""

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
    def enqueued_ms(self) -> int:
        """The ms part of an auto-generated id is when the producer's XADD ran."""
        try:
            return int(self.entry_id.split("-", 1)[0])
        except ValueError:
            return 0


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _pairs(flat: Any) -> dict[bytes, bytes]:
    items = list(flat or [])
    return fields_of(dict(zip(items[0::2], items[1::2])))


def _is_nogroup(exc: Exception) -> bool:
    """NOGROUP, or Redis 7 unblocking a blocked read because the stream key was deleted."""
    return isinstance(exc, redis.ResponseError) and (
        "NOGROUP" in str(exc) or "no longer exists" in str(exc))


class Intake:
    """Reads entries for one worker (consumer name == worker id)."""

    def __init__(self, client: redis.Redis, keys: Keys, worker_id: str,
                 on_group_recreated: Optional[Callable[[str], None]] = None) -> None:
        self.client = client
        self.keys = keys
        self.worker_id = worker_id
        self.fence = Fence(keys, worker_id)
        self._lanes = [(name, keys.lane(name)) for name in keys.LANES]
        self._lane_name = {key: name for name, key in self._lanes}
        self._on_group_recreated = on_group_recreated

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
        created = self.ensure_groups()
        if self._on_group_recreated:
            for key in created:
                self._on_group_recreated(key)

    def lane_name(self, lane_key: str) -> str:
        return self._lane_name.get(lane_key, "default")

    # ---------------------------------------------------------------- new entries
    def read_new(self, count: int, block_ms: int = 0) -> list[Entry]:
        """Up to ``count`` new entries, urgent lane first. Blocks (up to ``block_ms``) only if
        every lane is empty; a blocking read takes at most one entry per lane."""
        if count <= 0:
            return []
        out = self.new_entries(self._script_reply(lambda p: self.read_new_into(p, count)))
        if out or block_ms <= 0:
            return out
        got = self._xreadgroup({key: ">" for _, key in self._lanes}, 1, block_ms)
        order = {key: i for i, (_, key) in enumerate(self._lanes)}
        got.sort(key=lambda e: order[e.lane_key])
        if got and len(got) < count:  # woken by a burst: take the rest of it before stepping
            got += self.read_new(count - len(got), 0)
        return got

    def read_new_into(self, pipe: ScriptPipeline, count: int) -> int:
        """Queue a non-blocking read of up to ``count`` new entries (urgent first) on a pipeline,
        so the service loop can ride it on its per-step flush; see ``new_entries``."""
        return self.fence.read_new(pipe, [key for _, key in self._lanes], count)

    def new_entries(self, reply: Any) -> list[Entry]:
        """Entries of a READ_NEW reply; a NOGROUP reply recreates the groups (none read)."""
        if isinstance(reply, Exception):
            if not _is_nogroup(reply):
                raise reply
            self._recreate_groups()
            return []
        return [Entry(self._lanes[int(i) - 1][0], self._lanes[int(i) - 1][1], _text(eid),
                      _pairs(fields), 1, "new") for i, eid, fields in reply or []]

    def _xreadgroup(self, streams: dict[str, str], count: int, block: Optional[int]) -> list[Entry]:
        try:
            reply = self.client.xreadgroup(GROUP, self.worker_id, streams, count=count, block=block)
        except redis.ResponseError as exc:
            if not _is_nogroup(exc):
                raise
            self._recreate_groups()
            reply = self.client.xreadgroup(GROUP, self.worker_id, streams, count=count, block=None)
        return self._entries(reply, "new")

    def _entries(self, reply: Any, source: str) -> list[Entry]:
        if not reply:
            return []
        pairs = reply.items() if isinstance(reply, dict) else reply
        out = []
        for stream, entries in pairs:
            key = _text(stream)
            for entry_id, fields in entries:
                if entry_id is None:
                    continue
                out.append(Entry(self.lane_name(key), key, _text(entry_id),
                                 None if fields is None else fields_of(fields), 1, source))
        return out

    # ---------------------------------------------------------------- own pending list
    def read_own_pending(self, page: int = 200) -> list[Entry]:
        """Every entry pending at this consumer, all lanes, urgent first (XREADGROUP ... 0)."""
        out: list[Entry] = []
        for name, key in self._lanes:
            start = "0"
            while True:
                rows = self._script_rows(lambda p: self.fence.read_own_pending(p, key, start, page))
                for entry_id, fields, deliveries in rows:
                    out.append(Entry(name, key, entry_id, fields, deliveries, "pending"))
                if len(rows) < page:
                    break
                start = rows[-1][0]
        return out

    def claim_parked(self, count: int) -> list[Entry]:
        """Take up to ``count`` entries a draining worker handed back (no delivery counted)."""
        out: list[Entry] = []
        for name, key in self._lanes:
            if len(out) >= count:
                break
            rows = self._script_rows(lambda p: self.fence.claim_parked(p, key, count - len(out)))
            out.extend(Entry(name, key, i, f, d, "parked") for i, f, d in rows)
        return out

    def _script_rows(self, add: Callable[[ScriptPipeline], int]) -> list:
        return parse_raw_entries(self._script_reply(add))

    def _script_reply(self, add: Callable[[ScriptPipeline], int]) -> Any:
        """Run one script; on NOGROUP recreate the groups and run it once more."""
        for attempt in (0, 1):
            pipe = ScriptPipeline(self.client)
            add(pipe)
            reply = pipe.execute()[0]
            if isinstance(reply, Exception):
                if attempt == 0 and _is_nogroup(reply):
                    self._recreate_groups()
                    continue
                raise reply
            return reply
        return []

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
                if _text(g.get("name", b"")) == GROUP:
                    out[name] = (int(g.get("lag") or 0), int(g.get("pending") or 0))
        return out
