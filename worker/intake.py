"""Intake: which entries to take next, and from where.

In order: the worker's own pending list after every (re)connect (it may hold entries a broken
blocking read delivered but never returned); entries put back by a transient Redis error
(retried as they are, without a re-read that would count a delivery); entries read along with
the previous flush; reclaims of dead workers' entries (every lease/6) and parked hand-backs;
then new entries, urgent lane first, never more than the engine can start (what a worker reads
ages in its pending list). The worker blocks on Redis only when it has nothing else to do.
"""

from __future__ import annotations

from typing import Any, Optional

from worker.pending import Entry, PendingList
from worker.scripts import ScriptPipeline


class Intake:
    def __init__(self, worker: Any) -> None:
        self.w = worker
        self.need_own_pending = True
        self.deferred: list[Entry] = []              # put back by a transient error
        self.prefetched: Optional[list[Entry]] = None

    @property
    def pending(self) -> PendingList:
        return self.w.pending

    def capacity(self) -> int:
        try:
            return max(0, int(self.w.engine.free_capacity()))
        except Exception:  # a broken stats path must not stop the worker
            return 0

    def held(self) -> list[tuple[str, str]]:
        return [e.key for e in self.deferred + (self.prefetched or [])]

    def defer(self, entries: list[Entry]) -> None:
        self.deferred += entries

    def collect(self, block: bool) -> list[Entry]:
        """The entries to admit now (own pending list first, after a reconnect)."""
        w = self.w
        if self.need_own_pending:
            own = self.pending.read_own_pending()
            self.need_own_pending = False
            if own:
                w.log.info("re-reading own pending entries", count=len(own))
                return own
        entries, self.deferred = self.deferred, []
        prefetched, self.prefetched = self.prefetched, None
        entries += prefetched or []
        cap = self.capacity() - len(entries)
        if cap > 0 and w.liveness.due("reclaim", max(0.2, w.s.lease_ms / 6000.0)):
            entries += w.affinity.reclaim(cap, w.s.lease_ms)    # a dead worker's routed jobs
            entries += self.pending.reclaim(self.capacity() - len(entries), w.s.lease_ms)
        cap = self.capacity() - len(entries)
        if cap > 0 and (block or w.liveness.due("parked", w.s.heartbeat_ms / 1000.0)):
            entries += self.pending.reclaim(cap, None)
        cap = self.capacity() - len(entries)
        if cap > 0 and (prefetched is None or (block and not entries)):
            entries += self.pending.read_new(cap, w.s.block_ms if block and not entries else 0)
        return entries

    def prefetch_rider(self, pipe: ScriptPipeline) -> Any:
        """Ride the next iteration's read of new entries on the flush (while busy)."""
        w = self.w
        if w.stopping or not w.engine.has_unfinished_requests():
            return None
        cap = self.capacity()
        if cap <= 0:
            return None
        i = self.pending.queue_read_new(pipe, cap)

        def handle(res: list) -> None:
            self.prefetched = self.pending.new_entries(res[i])
        return handle

    def hand_back_prefetched(self) -> None:
        """Entries read with the last flush but not admitted yet go back at once (drain)."""
        entries, self.prefetched = (self.prefetched or []) + self.deferred, None
        self.deferred = []
        if entries:
            self.pending.park(e.key for e in entries)
            self.w.log.info("handed back unstarted entries", count=len(entries))
