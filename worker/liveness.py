"""Liveness: the worker id lease, the heartbeat, the admin's drain flag and lease renewal.

Two live processes under one consumer name would see one pending list: each would re-read,
renew and ack the other's entries, so the worker id is a lease (``WorkerIdLease``) held through
the heartbeat hash. Every heartbeat also tells operators what the worker holds (``python -m
worker health``, ``admin workers``) and polls the drain flag an admin may set.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import redis

from tokenrelay.protocol.heartbeat import Heartbeat
from tokenrelay.protocol.keys import Keys
from tokenrelay.protocol.scripts import ID_CLAIM, ID_RELEASE, run_script, text
from tokenrelay.protocol.wire import now_ms
from tokenrelay.worker.affinity import Affinity
from tokenrelay.worker.config import WorkerSettings
from tokenrelay.worker.connection import EXIT_CONFIG, ServerRestarts
from tokenrelay.worker.entries import EntryKey
from tokenrelay.worker.metrics import WorkerMetrics
from tokenrelay.worker.model_guard import serves_queue
from tokenrelay.worker.pending import PendingList
from tokenrelay.worker.connection import RedisClient
from tokenrelay.worker.logs import Log


class WorkerIdInUse(RuntimeError):
    """Another live process serves under this worker id (consumer name)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class WorkerIdLease:
    """The worker id as a lease held by one process at a time.

    The heartbeat hash carries an ``instance`` field (``host:pid:token``, protocol/heartbeat.py);
    ``acquire`` takes it only when it is absent, expired, or left by a dead process on this host (a
    supervisor restarting a crashed worker must not wait for the TTL); ``still_mine`` is checked
    with every heartbeat so a process that stalled past the TTL and was replaced learns it and
    exits instead of fighting its successor.
    """

    def __init__(self, client: redis.Redis, keys: Keys, worker_id: str, ttl_ms: int) -> None:
        self.client = client
        self.key = keys.heartbeat(worker_id)
        self.worker_id = worker_id
        self.ttl_ms = ttl_ms
        self.host = socket.gethostname()
        self.instance = f"{self.host}:{os.getpid()}:{secrets.token_hex(4)}"
        self.held = False

    def _try(self, force: bool = False) -> bool:
        got = text(run_script(self.client, ID_CLAIM, [self.key],
                              [self.instance, self.ttl_ms, int(force)]))
        self.held = got == self.instance
        return self.held

    def _holder(self) -> Heartbeat:
        return Heartbeat.decode(self.client.hgetall(self.key))

    def _holder_is_dead_here(self) -> bool:
        info = self._holder()
        instance = info.instance.split(":")     # host:pid:token
        try:
            pid = info.pid or int(instance[1])
        except (ValueError, IndexError):
            return False
        host = info.host or instance[0]
        return host == self.host and (pid == os.getpid() or not _pid_alive(pid))

    def acquire(self, wait_s: Optional[float] = None) -> None:
        """Take the id, waiting up to ``wait_s`` (default: one TTL) for a holder on another host
        to expire; raises WorkerIdInUse when a live holder keeps it."""
        if self._try():
            return
        if self._holder_is_dead_here():
            self._try(force=True)
            return
        deadline = time.monotonic() + (self.ttl_ms / 1000.0 + 0.5 if wait_s is None else wait_s)
        while time.monotonic() < deadline:
            time.sleep(0.1)
            if self._try():
                return
        info = self._holder()
        raise WorkerIdInUse(
            f"worker id {self.worker_id!r} is in use by a live worker (host={info.host}, "
            f"pid={info.pid}, instance={info.instance}); give each worker its own "
            f"--worker-id, or stop the other one first")

    def still_mine(self) -> bool:
        """Refresh the claim; False when another process took the id (we stalled past the TTL)."""
        return self.held and self._try()

    def release(self) -> None:
        """Delete the heartbeat only if it is still ours (never a successor's)."""
        if self.held:
            run_script(self.client, ID_RELEASE, [self.key], [self.instance])
            self.held = False


class Cadence:
    """When periodic tasks are due: each ``due`` call that returns True books the next run
    ``every_s`` later (monotonic clock)."""

    def __init__(self) -> None:
        self._next: dict[str, float] = defaultdict(float)

    def due(self, task: str, every_s: float) -> bool:
        now = time.monotonic()
        if now < self._next[task]:
            return False
        self._next[task] = now + every_s
        return True


@dataclass(frozen=True)
class WorkerStatus:
    """What the loop reports in a heartbeat, besides what Liveness knows itself."""

    engine_loaded: bool
    draining: bool
    held: int                   # jobs held
    running: int                # the engine's running and waiting sequences
    waiting: int
    redis_error: str            # the transient error being waited out ('' when none)
    tool_format: str = ""       # what the chat template does with tools (protocol/tools.py)


@dataclass
class Tick:
    """What one ``Liveness.tick`` found that the loop acts on."""

    lost_worker_id: bool = False    # another process serves under our id now: stop at once
    drain_requested: bool = False   # an admin set our drain flag, or the queue is taken:
    exit_code: int = 0              # 78 when another model serves our queue (model_guard.py)
    lost_entries: list[EntryKey] = field(default_factory=list)   # reclaimed from us
    redis_restarted: bool = False   # the server's run id changed (worker/connection.py)


class Liveness:
    """Periodic housekeeping of one worker: heartbeat (with the id lease and drain flag), the
    affinity sweep, lease renewal of everything held, lane metrics. ``tick`` runs what is due
    and reports what the loop must act on; the loop supplies what the beat reports
    (``status``) and what is held (``held``), both read only when due."""

    def __init__(self, client: RedisClient, keys: Keys, worker_id: str, settings: WorkerSettings,
                 pending: PendingList, affinity: Affinity, metrics: WorkerMetrics, log: Log,
                 status: Callable[[], WorkerStatus], held: Callable[[], list[EntryKey]]) -> None:
        self.client = client
        self.keys = keys
        self.worker_id = worker_id
        self.s = settings
        self.pending = pending
        self.affinity = affinity
        self.metrics = metrics
        self.log = log
        self._status = status
        self._held = held
        self.id_lease: Optional[WorkerIdLease] = None
        self.cadence = Cadence()
        self._started_ms = now_ms()
        self.restarts = ServerRestarts(client, log)

    def claim_worker_id(self) -> bool:
        """One live process per worker id; False (exit code 3) when a live worker holds it."""
        self.id_lease = WorkerIdLease(self.client, self.keys, self.worker_id,
                                      5 * self.s.heartbeat_ms)
        try:
            self.id_lease.acquire()
        except WorkerIdInUse as exc:
            self.log.error("worker id in use; exiting", error=str(exc))
            return False
        self.client.delete(self.keys.drain(self.worker_id))  # a flag meant for our predecessor
        self.heartbeat()  # the claim created the hash: fill it in before anyone reads it
        return True

    def tick(self, draining: bool) -> Tick:
        """Run what is due: beat (stopping there when the id was lost) and the server's run
        id, sweep, renew, lane metrics (not while ``draining``)."""
        out = Tick()
        hb = self.s.heartbeat_ms / 1000.0
        due = self.cadence.due
        if due("heartbeat", hb):
            if self.id_lease is not None and not self.id_lease.still_mine():
                out.lost_worker_id = True
                return out
            out.drain_requested = self.heartbeat()
            if out.drain_requested and not draining:
                self.log.info("drain requested by admin")
            out.redis_restarted = self.restarts.restarted()
        if due("affinity", hb):
            self.affinity.sweep()
        if due("renew", self.s.lease_ms / 3000.0):
            held = self._held()
            out.lost_entries = self.pending.renew(held) if held else []
        if not draining and due("queue_model", 10 * hb) and not serves_queue(
                self.client, self.keys, self.worker_id, self.s, self.log):
            out.drain_requested, out.exit_code = True, EXIT_CONFIG  # e.g. back from a partition
        if not draining and due("departed", 10 * hb):
            self.drop_departed()
        if not draining and due("lane_stats", 5 * hb):
            for lane, (lag, pending) in self.pending.lane_stats().items():
                self.metrics.stream_lag.labels(lane).set(lag)
                self.metrics.stream_pending.labels(lane).set(pending)
        return out

    def drop_departed(self) -> None:
        """Remove departed workers (no heartbeat, nothing pending) from the consumer groups;
        housekeeping, so a failure is logged and tried again at the next turn."""
        def alive(names: list[str]) -> list[bool]:
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                pipe.exists(self.keys.heartbeat(name))
            return [bool(x) for x in pipe.execute()]
        try:
            removed = self.pending.drop_departed(alive)
        except redis.RedisError as exc:
            self.log.warning("could not remove departed consumers", error=str(exc))
            return
        if removed:
            self.log.info("departed workers removed from the consumer groups",
                          consumers=sorted({n for _, n in removed}), lanes=len(removed))

    def heartbeat(self) -> bool:
        """Beat; returns True when an admin asked this worker to drain."""
        st, s = self._status(), self.s
        key = self.keys.heartbeat(self.worker_id)
        beat = Heartbeat(
            ts=now_ms(), pid=os.getpid(), host=socket.gethostname(), queue=s.queue,
            model=str(s.model), served_model_name=s.served_model(), started_ms=self._started_ms,
            engine_loaded=st.engine_loaded, draining=st.draining, held=st.held,
            running=st.running, waiting=st.waiting, redis_error=st.redis_error,
            affinity=True, affinity_queued=self.affinity.unread(),
            tool_format=st.tool_format)
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(key, mapping=beat.encode())
        pipe.pexpire(key, 5 * s.heartbeat_ms)
        pipe.zadd(self.keys.workers, {self.worker_id: now_ms()})
        pipe.sadd(self.keys.queues, s.queue)
        pipe.exists(self.keys.drain(self.worker_id))
        return bool(pipe.execute()[-1])

    def shutdown(self) -> None:
        """Leave the registry and release the id (only if still ours). A worker whose affinity
        streams still hold entries stays registered, so other workers find and sweep them."""
        if self.id_lease is None or self.id_lease.held:
            try:
                emptied = self.affinity.close()
            except redis.RedisError as exc:       # swept by the others once our beat is gone
                self.log.warning("could not empty own affinity streams", error=str(exc))
                emptied = False
            if emptied:
                self.client.zrem(self.keys.workers, self.worker_id)
        if self.id_lease is not None:
            self.id_lease.release()

