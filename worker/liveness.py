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
from typing import Any, Callable, Optional

import redis

from protocol.keys import Keys
from protocol.tools import TOOL_FORMAT_FIELD
from protocol.wire import now_ms
from worker.scripts import ID_CLAIM, ID_RELEASE, run_script, text


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

    The heartbeat hash carries an ``instance`` field (``host:pid:token``); ``acquire`` takes it
    only when it is absent, expired, or left by a dead process on this host (a supervisor
    restarting a crashed worker must not wait for the TTL); ``still_mine`` is checked with every
    heartbeat so a process that stalled past the TTL and was replaced learns it and exits
    instead of fighting its successor.
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

    def _holder(self) -> dict[str, str]:
        return {text(k): text(v) for k, v in self.client.hgetall(self.key).items()}

    def _holder_is_dead_here(self) -> bool:
        info = self._holder()
        try:
            pid = int(info.get("pid", "") or info.get("instance", "::").split(":")[1])
        except (ValueError, IndexError):
            return False
        host = info.get("host") or info.get("instance", "").split(":")[0]
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
            f"worker id {self.worker_id!r} is in use by a live worker (host={info.get('host')}, "
            f"pid={info.get('pid')}, instance={info.get('instance')}); give each worker its own "
            f"--worker-id, or stop the other one first")

    def still_mine(self) -> bool:
        """Refresh the claim; False when another process took the id (we stalled past the TTL)."""
        return self.held and self._try()

    def release(self) -> None:
        """Delete the heartbeat only if it is still ours (never a successor's)."""
        if self.held:
            run_script(self.client, ID_RELEASE, [self.key], [self.instance])
            self.held = False


class Liveness:
    """Periodic housekeeping of one worker: heartbeat (with the id lease and drain flag), lease
    renewal of everything held, lane metrics. ``tick`` runs what is due."""

    def __init__(self, worker: Any) -> None:
        self.w = worker
        self.id_lease: Optional[WorkerIdLease] = None
        self._next: dict[str, float] = defaultdict(float)
        self._started_ms = now_ms()

    def due(self, task: str, every_s: float) -> bool:
        now = time.monotonic()
        if now < self._next[task]:
            return False
        self._next[task] = now + every_s
        return True

    def claim_worker_id(self) -> bool:
        """One live process per worker id; False (exit code 3) when a live worker holds it."""
        w = self.w
        self.id_lease = WorkerIdLease(w.client, w.keys, w.worker_id, 5 * w.s.heartbeat_ms)
        try:
            self.id_lease.acquire()
        except WorkerIdInUse as exc:
            w.log.error("worker id in use; exiting", error=str(exc))
            return False
        w.client.delete(w.keys.drain(w.worker_id))  # a flag meant for our predecessor
        self.heartbeat()  # the claim created the hash: fill it in before anyone reads it
        return True

    def tick(self, on_lost_id: Callable[[], None], on_lost_entry: Callable[[str, str], None],
             on_drain: Callable[[], None]) -> None:
        s = self.w.s
        hb = s.heartbeat_ms / 1000.0
        if self.due("heartbeat", hb):
            if self.id_lease is not None and not self.id_lease.still_mine():
                on_lost_id()
                return
            if self.heartbeat():
                on_drain()
        if self.due("affinity", hb):
            self.w.affinity.sweep()
        if self.due("renew", s.lease_ms / 3000.0):
            held = self.w.held_entries()
            for lane, entry_id in self.w.pending.renew(held) if held else []:
                on_lost_entry(lane, entry_id)
        if not self.w.draining and self.due("lane_stats", 5 * hb):
            for lane, (lag, pending) in self.w.pending.lane_stats().items():
                self.w.metrics.stream_lag.labels(lane).set(lag)
                self.w.metrics.stream_pending.labels(lane).set(pending)

    def heartbeat(self) -> bool:
        """Beat; returns True when an admin asked this worker to drain."""
        w = self.w
        stats = w.engine_stats()
        key = w.keys.heartbeat(w.worker_id)
        pipe = w.client.pipeline(transaction=False)
        pipe.hset(key, mapping={
            "ts": now_ms(), "engine_loaded": int(not w.engine_broken), "pid": os.getpid(),
            "host": socket.gethostname(), "queue": w.s.queue, "model": str(w.s.model),
            "served_model_name": w.s.served_model(),
            TOOL_FORMAT_FIELD: tool_format(w.engine),
            "started_ms": self._started_ms, "draining": int(w.draining), "held": len(w.jobs),
            "running": stats.get("num_running", 0), "waiting": stats.get("num_waiting", 0),
            "redis_error": w.redis_error or "", **w.affinity.heartbeat_fields()})
        pipe.pexpire(key, 5 * w.s.heartbeat_ms)
        pipe.zadd(w.keys.workers, {w.worker_id: now_ms()})
        pipe.sadd(w.keys.queues, w.s.queue)
        pipe.exists(w.keys.drain(w.worker_id))
        return bool(pipe.execute()[-1])

    def shutdown(self) -> None:
        """Leave the registry and release the id (only if still ours). A worker whose affinity
        streams still hold entries stays registered, so other workers find and sweep them."""
        if self.id_lease is None or self.id_lease.held:
            try:
                emptied = self.w.affinity.close()
            except redis.RedisError as exc:       # swept by the others once our beat is gone
                self.w.log.warning("could not empty own affinity streams", error=str(exc))
                emptied = False
            if emptied:
                self.w.client.zrem(self.w.keys.workers, self.w.worker_id)
        if self.id_lease is not None:
            self.id_lease.release()


def tool_format(engine: Any) -> str:
    """What the engine's chat template does with tools (protocol/tools.py), for the
    heartbeat; "" when the engine cannot say (producers then treat it as an older worker)."""
    try:
        return str(engine.tool_call_format)
    except Exception:  # an engine without the attribute, or a template that broke: unknown
        return ""
