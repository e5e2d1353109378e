"""Shared result readers for asyncio clients: a thousand waiting jobs, a few connections.

A web backend (or the gateway) with a thousand concurrent ``AsyncJob.stream()`` calls must not
hold a thousand Redis connections, each blocked in its own XREAD. ``ReadHub`` reads the result
streams of every job being waited for with a few readers instead: one task per *group* of at
most ``per_reader`` streams of one cluster slot, each blocked in one XREAD over its group
(``ResultReader.pump``, the same read, retries and fold as every other reader), fanning what it
reads out to the waiting tasks. A waiter registers while it waits (``watching``) and is dropped
the moment it leaves, so an abandoned request holds nothing.

A job joining a group whose reader is blocked would wait out the block: the hub interrupts it
with an XADD to the group's private *wake stream* (``protocol.keys.wake_key``, in the group's
slot, named in the same XREAD), at most one per block. With ``wake=False`` readers block in
slices of ``SLICE_MS`` instead (no extra key; a join waits up to one slice).

Every group's loop also runs what a reader decides by itself (``ClientCore._settle``): jobs no
worker started by their deadline end ``expired`` and are cancelled, jobs whose records Redis
lost are enqueued again or end ``job_lost``; each job by the client that submitted it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass, field
from itertools import count
from typing import Any, Awaitable, Callable, Iterator, Optional

from tokenrelay.producer_sdk.core.effects import Call, Plan
from tokenrelay.producer_sdk.jobs.job import JobHandle, JobState
from tokenrelay.producer_sdk.core.reads import ResultReader
from tokenrelay.protocol.keys import WAKE_TTL_MS, key_slot, wake_key

log = logging.getLogger("tokenrelay.producer_sdk.core.hub")

SLICE_MS = 50           # the block of a reader without a wake stream
ERROR_PAUSE_S = 0.5     # after a read that failed past its retries, before reading again

Runner = Callable[[Plan[Any]], Awaitable[Any]]


@dataclass(eq=False)
class Watch:
    """One job being waited for: its state, the client that submitted it (whose plans settle
    it), how many waits hold it, their futures, and the group that reads it."""

    state: JobState
    owner: Any
    group: "Group"
    refs: int = 0
    waiters: list[asyncio.Future] = field(default_factory=list)

    def notify(self, error: Optional[BaseException] = None) -> None:
        for fut in self.waiters:
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(None)


@dataclass(eq=False)
class Group:
    """One shared reader: the streams of one slot it reads, its wake stream, its task."""

    slot: int
    wake_key: str
    watches: dict[str, Watch] = field(default_factory=dict)
    wake_last: bytes = b"0-0"
    blocking: bool = False      # inside its XREAD (a join must wake it)
    woken: bool = False         # a wake was sent during this XREAD
    task: Optional[asyncio.Task] = None


class ReadHub:
    """The shared readers of one or more asyncio clients on one Redis (client).

    ``run`` runs a plan on that Redis (an ``AsyncClient._run``), ``reader`` reads (its retries
    and timeouts), ``namespace`` names the wake streams; ``per_reader`` streams per reader,
    ``max_readers`` readers at most (past it groups grow), ``block_ms`` the longest block."""

    def __init__(self, run: Runner, reader: ResultReader, namespace: str, *,
                 per_reader: int = 256, max_readers: int = 32, block_ms: int = 2000,
                 wake: bool = True) -> None:
        self.run = run
        self.reader = reader
        self.namespace = namespace
        self.per_reader = per_reader
        self.max_readers = max_readers
        self.block_ms = block_ms
        self.wake = wake
        self.watches: dict[str, Watch] = {}
        self.slots: dict[int, list[Group]] = {}
        self._ids = count()
        self._token = os.urandom(6).hex()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._background: set[asyncio.Task] = set()
        self._noperm_logged = False
        self._closed = False

    # -- what waiters use
    @contextlib.contextmanager
    def watching(self, job: JobHandle) -> Iterator[Watch]:
        """Register ``job`` with a reader while the block runs; dropped at once on exit."""
        self._same_loop()
        state = job.state
        w = self.watches.get(state.key)
        if w is None:
            w = self.watches[state.key] = self._place(state, job.client)
        w.refs += 1
        try:
            yield w
        finally:
            w.refs -= 1
            if w.refs == 0:
                self._drop(w)

    async def wait(self, w: Watch, timeout_s: Optional[float]) -> None:
        """Until the job's reader brought it entries or it ended (or ``timeout_s`` passed);
        raises what made its reader give up (RedisUnavailable)."""
        fut = asyncio.get_running_loop().create_future()
        w.waiters.append(fut)
        try:
            await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            pass
        finally:
            w.waiters.remove(fut)

    @property
    def readers(self) -> int:
        """Readers (groups) running now."""
        return sum(1 for gs in self.slots.values() for g in gs
                   if g.task is not None and not g.task.done())

    async def close(self) -> None:
        """Stop every reader (waiters still blocked time out on their own). A reader's task is
        cancelled and given a second to end: redis-py can lose a cancellation that lands while
        it tears a connection down (its retry resends the read), so the loop also stops at
        the closed flag, once closing the client's pool ends that read."""
        self._closed = True
        tasks = [g.task for gs in self.slots.values() for g in gs if g.task is not None]
        tasks += list(self._background)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        self.slots.clear()
        self.watches.clear()

    # -- groups
    def _same_loop(self) -> None:
        """A hub's tasks live on one event loop; used from another (a new ``asyncio.run``),
        it starts afresh."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop = loop
            self.slots.clear()
            self.watches.clear()
            self._background.clear()

    def _place(self, state: JobState, owner: Any) -> Watch:
        slot = key_slot(state.key)
        groups = self.slots.setdefault(slot, [])
        group = next((g for g in groups if len(g.watches) < self.per_reader), None)
        if group is None:
            total = sum(len(gs) for gs in self.slots.values())
            if groups and total >= self.max_readers:
                group = min(groups, key=lambda g: len(g.watches))
            else:
                group = Group(slot, wake_key(self.namespace, state.key,
                                             f"{self._token}-{next(self._ids)}"))
                groups.append(group)
        w = Watch(state, owner, group)
        group.watches[state.key] = w
        state.caught_up = False             # no read has covered it yet
        if group.task is None or group.task.done():
            group.task = asyncio.create_task(self._read_loop(group),
                                             name=f"tokenrelay-reader-{slot}")
        elif group.blocking:
            self._wake(group)
        return w

    def _drop(self, w: Watch) -> None:
        self.watches.pop(w.state.key, None)
        w.group.watches.pop(w.state.key, None)

    def _wake(self, group: Group) -> None:
        if not self.wake or group.woken:
            return
        group.woken = True
        task = asyncio.create_task(self._send_wake(group.wake_key))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_wake(self, key: str) -> None:
        def xadd(r: Any) -> Any:
            pipe = r.pipeline(transaction=False)
            pipe.xadd(key, {"w": b"1"}, maxlen=1, approximate=False)
            pipe.pexpire(key, WAKE_TTL_MS)
            return pipe.execute(False)
        def plan() -> Plan[Any]:
            return (yield Call(xadd))
        try:
            replies = await self.run(plan())
        except Exception as exc:    # the reader's own block ends soon enough; its read retries
            log.debug("wake of %s failed: %s", key, exc)
            return
        if isinstance(replies[-1], Exception) and not self._noperm_logged:
            self._noperm_logged = True
            log.warning("wake streams cannot expire (%s): allow PEXPIRE on the namespace's "
                        "keys (docs/operations.md)", replies[-1])

    # -- one reader
    async def _read_loop(self, g: Group) -> None:
        """Read the group's streams until none of its jobs is left unfinished."""
        while not self._closed:
            watches = list(g.watches.values())
            states = [w.state for w in watches if not w.state.finished]
            if not states:
                return
            extra = {g.wake_key: g.wake_last} if self.wake else None
            block = self.block_ms if self.wake else min(self.block_ms, SLICE_MS)
            g.blocking, g.woken = True, False
            try:
                got = await self.run(self.reader.pump(states, block, extra))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                g.blocking = False
                log.warning("a shared reader of %d streams gave up: %r", len(states), exc,
                            exc_info=exc)
                for w in watches:
                    w.notify(exc)
                await asyncio.sleep(ERROR_PAUSE_S)
                continue
            g.blocking = False
            if extra is not None:
                g.wake_last = extra[g.wake_key]
            touched = {id(s) for s, _ in got} | await self._settle(watches)
            for w in watches:
                if id(w.state) in touched or w.state.finished:
                    w.notify()

    async def _settle(self, watches: list[Watch]) -> set[int]:
        """``ClientCore._settle`` of the group's unfinished jobs, each by its own client."""
        by_owner: dict[int, tuple[Any, list[JobState]]] = {}
        for w in watches:
            if not w.state.finished:
                by_owner.setdefault(id(w.owner), (w.owner, []))[1].append(w.state)
        ended: set[int] = set()
        for owner, states in by_owner.values():
            try:
                ended.update(id(s) for s in await owner._run(owner._settle(states)))
            except asyncio.CancelledError:
                raise
            except Exception as exc:    # tried again at the next read
                log.warning("settling %d waited-for jobs failed: %s", len(states), exc)
        return ended


__all__ = ["ReadHub", "Watch", "SLICE_MS"]
