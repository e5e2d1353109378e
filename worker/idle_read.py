"""The idle worker's blocking read: sleep until a new entry lands on any lane (or the worker's
own affinity stream, worker/affinity.py) of any shard, without polling and without a thread.

On one Redis a single ``XREADGROUP ... BLOCK`` names every such stream of every shard. In a
Redis Cluster one command's keys must share a slot, so there is one blocking read per shard (its
streams share the shard's hash tag), each on its own connection to the master serving that shard; the
worker sleeps in ``select()`` on all of them and the first reply wakes it.

The other reads stay outstanding until they time out (``--block-ms``) or bring an entry.
``poll`` collects what they brought at every loop iteration: entries delivered to a blocked
read are pending under this worker, so they are never dropped; the intake admits them when
there is room and hands them back otherwise. They are not cancelled with ``CLIENT UNBLOCK``:
that would cost a second connection per node, a round trip at every wake-up and
``+client|unblock`` in the worker's ACL, to save a connection held for at most ``--block-ms``.
A connection lost while a read was outstanding may have lost entries delivered to it, so the
caller re-reads its own pending list after ``ReadLost`` (as after any reconnect).
"""

from __future__ import annotations

import select
import time
from typing import Any, Callable, Optional, Sequence

import redis

from tokenrelay.protocol.topology import node_client

# (lane key, entry id, flat fields) of one entry a blocking read brought
Arrival = tuple[str, str, list]


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, (bytes, bytearray)) else str(v)


class _Read:
    """One group of lanes that fit in one XREADGROUP, its connection and its read in flight."""

    def __init__(self, lanes: Sequence[str]) -> None:
        self.lanes = list(lanes)
        self.conn: Any = None
        self.pool: Any = None
        self.outstanding = False

    def drop(self) -> None:
        if self.conn is not None:
            self.conn.disconnect()
            self.pool.release(self.conn)
        self.conn, self.pool, self.outstanding = None, None, False


class IdleRead:
    """Blocking reads over ``groups`` of lanes (each group shares a slot, or every lane on a
    single Redis) for ``consumer``; see the module docstring. ``on_nogroup`` recreates the
    consumer groups (a Redis restarted without persistence, or a lane deleted)."""

    def __init__(self, client: Any, groups: Sequence[Sequence[str]], group: str, consumer: str,
                 on_nogroup: Callable[[], None]) -> None:
        self.client = client
        self.group = group
        self.consumer = consumer
        self.on_nogroup = on_nogroup
        self._reads = [_Read(g) for g in groups if g]

    @property
    def outstanding(self) -> int:
        return sum(r.outstanding for r in self._reads)

    def wait(self, block_ms: int) -> list[Arrival]:
        """Start a blocking read on every group not already waiting, then sleep until one
        answers (at most ``block_ms`` plus a margin for the server's own timeout)."""
        for r in self._reads:
            if not r.outstanding:
                self._start(r, block_ms)
        return self._collect(time.monotonic() + block_ms / 1000.0 + 1.0)

    def poll(self) -> list[Arrival]:
        """What outstanding reads brought by now (no waiting)."""
        return self._collect(None) if self.outstanding else []

    def finish(self, timeout_s: float) -> list[Arrival]:
        """Wait for every outstanding read to end (a drain hands back what they bring)."""
        deadline = time.monotonic() + timeout_s
        out: list[Arrival] = []
        while self.outstanding and time.monotonic() < deadline:
            out += self._collect(deadline)
        self.close()
        return out

    def close(self) -> None:
        """Drop every connection (their reads with them: see ReadLost)."""
        for r in self._reads:
            r.drop()

    # ------------------------------------------------------------------ internals
    def _start(self, r: _Read, block_ms: int) -> None:
        if r.conn is None:
            r.pool = node_client(self.client, r.lanes[0]).connection_pool
            r.conn = r.pool.get_connection()
        try:
            r.conn.send_command("XREADGROUP", "GROUP", self.group, self.consumer, "COUNT", 1,
                                "BLOCK", int(block_ms), "STREAMS", *r.lanes,
                                *([">"] * len(r.lanes)), check_health=False)
        except BaseException:
            self.close()
            raise
        r.outstanding = True

    def _collect(self, deadline: Optional[float]) -> list[Arrival]:
        """Read every reply that is ready; with a deadline, first sleep until one is."""
        waiting = [r for r in self._reads if r.outstanding]
        if not waiting:
            return []
        try:
            if deadline is not None:
                socks = [r.conn._sock for r in waiting]   # redis-py has no public fileno
                select.select(socks, [], [], max(0.0, deadline - time.monotonic()))
            out: list[Arrival] = []
            for r in waiting:
                if r.conn.can_read(timeout=0):
                    out += self._reply(r)
            return out
        except (redis.ConnectionError, redis.TimeoutError, OSError, ValueError, TypeError) as exc:
            self.close()
            raise ReadLost(f"blocking read lost its connection: {exc}") from exc

    def _reply(self, r: _Read) -> list[Arrival]:
        r.outstanding = False
        try:
            reply = r.conn.read_response()
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc) or "no longer exists" in str(exc):
                self.on_nogroup()
                return []
            self.close()   # e.g. MOVED: the next wait connects to the slot's master anew
            raise
        out: list[Arrival] = []
        for stream, entries in reply or []:
            out += [(_s(stream), _s(eid), fields) for eid, fields in entries or []
                    if eid is not None]
        return out


class ReadLost(redis.ConnectionError):
    """A blocking read's connection broke: entries it was given may be pending here unseen."""
