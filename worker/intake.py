"""Intake: which entries to take next, and from where.

In order: the worker's own pending list after every (re)connect (it may hold entries a broken
blocking read delivered but never returned); entries put back by a transient Redis error
(retried as they are, without a re-read that would count a delivery); entries read along with
the previous flush, and what blocking reads still outstanding brought; reclaims of dead
workers' entries (every lease/6); then parked hand-backs and new entries of every shard, urgent
lane first, never more than the engine can start (what a worker reads ages in its pending list;
what reads of several shards bring past that is handed back at once). The worker blocks on
Redis only when it has nothing else to do.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from tokenrelay.protocol.scripts import ScriptPipeline
from tokenrelay.worker.affinity import Affinity
from tokenrelay.worker.engine_api import EngineAPI
from tokenrelay.worker.entries import CHUNK, Entry, EntryKey, by_lane
from tokenrelay.worker.liveness import Cadence
from tokenrelay.worker.logs import RateLimitedLog
from tokenrelay.worker.pending import PendingList
from tokenrelay.worker.logs import Log


class Intake:
    """Decides what the worker reads next; see the module docstring. ``collect`` is the loop's
    read, the riders ride the flush."""

    def __init__(self, pending: PendingList, affinity: Affinity, engine: EngineAPI,
                 block_ms: int, lease_ms: int, log: Log, log_limited: RateLimitedLog) -> None:
        self.pending = pending
        self.affinity = affinity
        self.engine = engine
        self.block_ms = block_ms
        self.lease_ms = lease_ms
        self.log = log
        self.log_limited = log_limited
        self.cadence = Cadence()
        self.need_own_pending = True
        self.deferred: list[Entry] = []              # put back by a transient error
        self.prefetched: Optional[list[Entry]] = None
        self.surplus: list[Entry] = []               # read past capacity: to hand back

    def capacity(self) -> int:
        try:
            return max(0, int(self.engine.free_capacity()))
        except Exception:  # a broken stats path must not stop the worker
            return 0

    def held(self) -> list[EntryKey]:
        return [e.key for e in self.deferred + (self.prefetched or []) + self.surplus
                + self.pending.arrived]

    def defer(self, entries: list[Entry]) -> None:
        """Take ``entries`` again next, as they are (no re-read: their delivery counts stay):
        a batch a transient error put back, or a job to resume from what its stream holds."""
        self.deferred += entries

    def reread_own_pending(self) -> None:
        """Read the own pending list first next time (after a (re)connect: a broken read may
        have delivered entries it never returned)."""
        self.need_own_pending = True

    def collect(self, block: bool) -> list[Entry]:
        """The entries to admit now (own pending list first, after a reconnect)."""
        if self.need_own_pending:
            own = self.pending.read_own_pending()
            self.need_own_pending = False
            if own:
                self.log.info("re-reading own pending entries", count=len(own))
                return own
        entries, self.deferred = self.deferred, []
        prefetched, self.prefetched = self.prefetched, None
        entries += prefetched or []
        entries += self.fit(self.pending.take_arrived(), self.capacity() - len(entries))
        cap = self.capacity() - len(entries)
        if cap > 0 and self.cadence.due("reclaim", max(0.2, self.lease_ms / 6000.0)):
            entries += self.affinity.reclaim(cap, self.lease_ms)    # a dead worker's routed jobs
            entries += self.pending.reclaim(self.capacity() - len(entries), self.lease_ms)
        cap = self.capacity() - len(entries)
        if cap > 0 and (prefetched is None or (block and not entries)):
            wait = self.block_ms if block and not entries else 0
            entries += self.fit(self._read(lambda: self.pending.read_new(cap, wait)), cap)
        return entries

    def _read(self, read: Callable[[], list[Entry]]) -> list[Entry]:
        """A read of new entries; when it fails, a script may have read some for us before
        the error, so the own pending list is re-read next (as after a reconnect)."""
        try:
            return read()
        except Exception:
            self.need_own_pending = True
            raise

    def fit(self, entries: list[Entry], cap: int) -> list[Entry]:
        """Keep the ``cap`` most urgent entries a read brought (lane, then age, then the
        shards' turn). Reads of several shards, each asked for the whole capacity, and blocking
        reads still outstanding can bring more; the rest is handed back (parked) with the next
        flush, its delivery count unchanged, and the next read anywhere takes it first."""
        if len(entries) <= cap:
            return entries
        ranked = sorted(entries, key=self.pending.lanes.urgency)
        keep = max(0, cap)
        self.surplus += ranked[keep:]
        return ranked[:keep]

    def surplus_rider(self, pipe: ScriptPipeline) -> Any:
        """Hand back the surplus of the last reads, queued on the flush."""
        if not self.surplus:
            return None
        queued = [(lane, ids[k:k + CHUNK], self.pending.queue_park(pipe, lane, ids[k:k + CHUNK]))
                  for lane, ids in by_lane((e.lane_key, e.entry_id) for e in self.surplus).items()
                  for k in range(0, len(ids), CHUNK)]

        def handle(res: list) -> None:
            done = {(lane, eid) for lane, ids, i in queued if not isinstance(res[i], Exception)
                    for eid in ids}
            failed = next((res[i] for _, _, i in queued if isinstance(res[i], Exception)), None)
            if failed is not None:   # kept (and renewed): retried with the next flush
                self.log_limited("warning", "handing back surplus entries failed; will retry",
                                 error=str(failed))
            self.surplus = [e for e in self.surplus if e.key not in done]
            self.log.debug("handed back surplus entries", count=len(done))
        return handle

    def prefetch_rider(self, pipe: ScriptPipeline) -> Any:
        """Ride the next iteration's read of new entries on the flush (while busy; the loop
        does not offer it once stopping), sized when the flush is queued."""
        rider = self.prefetch()
        return rider(pipe) if rider is not None else None

    def prefetch(self) -> Optional[Callable[[ScriptPipeline], Any]]:
        """The next read of new entries as a rider, sized NOW (None: nothing to read): the
        loop sizes it before an engine step whose flush it rides, as the engine must not be
        asked anything while it steps. Its capacity only grows during the step (jobs end),
        so the read never brings more than the engine can start."""
        if not self.engine.has_unfinished_requests():
            return None
        cap = self.capacity()
        if cap <= 0:
            return None

        def rider(pipe: ScriptPipeline) -> Any:
            parse = self.pending.queue_read_new(pipe, cap)

            def handle(res: list) -> None:
                self.prefetched = self.fit(self._read(lambda: parse(res)), cap)
            return handle
        return rider

    def hand_back_prefetched(self) -> None:
        """Entries read but not admitted yet go back at once (drain): those read with the last
        flush, the surplus, and what blocking reads still outstanding bring."""
        late = self.pending.end_waits(self.block_ms / 1000.0 + 1.0)
        entries = (self.prefetched or []) + self.deferred + self.surplus + late
        self.prefetched, self.deferred, self.surplus = None, [], []
        if entries:
            self.pending.park(e.key for e in entries)
            self.log.info("handed back unstarted entries", count=len(entries))
