"""Cancels the gateway owes: a job whose client left, whose deadline passed or whose stream
gave up must never run on unwanted.

A cancel asked for while the request is being torn down (the client disconnected, the task is
being cancelled) cannot wait for Redis there, and one that fails must not be forgotten (a
swallowed cancel is a job that runs to its end for nobody and holds a worker's slot). So the
request hands the job's cancel flag to ``Cancels`` and leaves at once; one thread sends every
flag asked for since its last round in one pipeline (``ClientCore._cancel_jobs``, itself
retried through a failover) and keeps what failed for the next round, backing off while Redis
is down, for as long as the gateway runs. At shutdown it tries once more and names what it
could not send.

Why a thread with a blocking connection, not a task of the event loop: with 2,000 streams on
a 2-core host a turn of the gateway's loop took up to half a second, and a cancel sent by a
task waited for turns twice (to be sent, then for its reply before the next batch could go):
p99 19 engine steps between the disconnect and the send, 3 more for the reply (issue #42).
The thread waits only for the GIL (the interpreter's switch interval, 5 ms), whatever the
loop is doing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Optional

from tokenrelay.protocol.scripts.cancel import CancelTarget

log = logging.getLogger("tokenrelay.producer_sdk.gateway")

BATCH = 1000            # flags per pipeline
FIRST_PAUSE_S = 0.05
MAX_PAUSE_S = 5.0
JOIN_S = 10.0           # how long close waits for a send in flight


class Cancels:
    """Cancel flags to set, sent by one thread with retries. ``client`` is a sync ``Client``
    of the gateway's Redis on a connection of its own (its ``_cancel_jobs`` sets each job's
    flag with the cancel script, which skips a job Redis no longer holds). ``add`` is called
    from the event loop; everything else runs in the thread."""

    def __init__(self, client: Any, metrics: Any = None) -> None:
        self.client = client
        self.metrics = metrics
        self.keys: dict[CancelTarget, None] = {}     # ordered set: each job once
        self.sent = 0
        self.failures = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: Optional[threading.Thread] = None

    def add(self, key: CancelTarget) -> None:
        """Owe the cancel flag ``key``; returns at once (safe while a task is being cancelled)."""
        with self._cond:
            self.keys[key] = None
            self._gauge()
            if self._thread is None and not self._stopping:
                self._thread = threading.Thread(target=self._run, name="tokenrelay-cancels",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    @property
    def pending(self) -> int:
        return len(self.keys)

    def _run(self) -> None:
        """The thread: send what is owed, back off while it fails, until ``close``."""
        pause = FIRST_PAUSE_S
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self.keys or self._stopping)
                if self._stopping:
                    return
            if self._send_some():
                pause = FIRST_PAUSE_S
                continue
            with self._cond:
                self._cond.wait_for(lambda: self._stopping, pause)
            pause = min(pause * 2, MAX_PAUSE_S)

    def _send_some(self) -> bool:
        """One pipeline of up to ``BATCH`` flags, blocking; False when it failed (kept owed).
        Any exception is caught: one that ended the thread would leave every later cancel
        unsent, for the gateway's whole life."""
        with self._cond:
            batch = list(self.keys)[:BATCH]
        try:
            self.client._run(self.client._cancel_jobs(batch))
        except Exception as exc:
            self.failures += 1
            if self.metrics is not None:
                self.metrics.cancel_retries.inc()
            log.warning("could not set %d cancel flags yet (retrying): %s", len(batch), exc)
            return False
        with self._cond:
            for key in batch:
                self.keys.pop(key, None)
            self.sent += len(batch)
            self._gauge()
        return True

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.cancels_pending.set(len(self.keys))

    async def close(self) -> None:
        """Stop the thread, send what is owed once more (off the loop); name what could not
        be sent."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, JOIN_S)
        if self.keys:
            await asyncio.to_thread(self._send_some)
        if self.keys:
            log.error("gateway stopping with %d cancels not sent (their jobs may run): %s",
                      len(self.keys), ", ".join(t.flag for t in list(self.keys)[:20]))


__all__ = ["Cancels"]
