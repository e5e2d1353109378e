"""Cancels the gateway owes: a job whose client left, whose deadline passed or whose stream
gave up must never run on unwanted.

A cancel asked for while the request is being torn down (the client disconnected, the task is
being cancelled) cannot wait for Redis there, and one that fails must not be forgotten (a
swallowed cancel is a job that runs to its end for nobody and holds a worker's slot). So the
request hands the job's cancel flag to ``Cancels`` and leaves at once; one task sends every
flag asked for since its last round in one pipeline (``ClientCore._cancel_jobs``, itself
retried through a failover) and keeps what failed for the next round, backing off while Redis
is down, for as long as the gateway runs. At shutdown it tries once more and names what it
could not send.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Optional

from tokenrelay.protocol.scripts.cancel import CancelTarget

log = logging.getLogger("tokenrelay.producer_sdk.gateway")

BATCH = 1000            # flags per pipeline
MAX_PAUSE_S = 5.0


class Cancels:
    """Cancel flags to set, sent by one task with retries. ``client`` is any AsyncClient of
    the gateway's Redis (the client's ``_cancel_jobs`` sets each job's flag with the cancel
    script, which skips a job Redis no longer holds)."""

    def __init__(self, client: Any, metrics: Any = None) -> None:
        self.client = client
        self.metrics = metrics
        self.keys: dict[CancelTarget, None] = {}     # ordered set: each job once
        self.sent = 0
        self.failures = 0
        self._wake = asyncio.Event()
        self._task: Optional[asyncio.Task] = None

    def add(self, key: CancelTarget) -> None:
        """Owe the cancel flag ``key``; returns at once (safe while a task is being cancelled)."""
        self.keys[key] = None
        self._gauge()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(),
                                                                name="tokenrelay-cancels")
        self._wake.set()

    @property
    def pending(self) -> int:
        return len(self.keys)

    async def _run(self) -> None:
        pause = 0.05
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.keys:
                if await self._send_some():
                    pause = 0.05
                    continue
                await asyncio.sleep(pause)
                pause = min(pause * 2, MAX_PAUSE_S)

    async def _send_some(self) -> bool:
        batch = list(self.keys)[:BATCH]
        try:
            await self.client._run(self.client._cancel_jobs(batch))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.failures += 1
            if self.metrics is not None:
                self.metrics.cancel_retries.inc()
            log.warning("could not set %d cancel flags yet (retrying): %s", len(batch), exc)
            return False
        for key in batch:
            self.keys.pop(key, None)
        self.sent += len(batch)
        self._gauge()
        return True

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.cancels_pending.set(len(self.keys))

    async def close(self) -> None:
        """Send what is owed once more; name what could not be sent."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        if self.keys:
            with contextlib.suppress(Exception):
                await self._send_some()
        if self.keys:
            log.error("gateway stopping with %d cancels not sent (their jobs may run): %s",
                      len(self.keys), ", ".join(t.flag for t in list(self.keys)[:20]))


__all__ = ["Cancels"]
