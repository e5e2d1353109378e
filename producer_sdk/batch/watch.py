"""Say so while a batch waits on a queue no live worker serves.

A batch may be queued before any worker starts (the runner waits for one), but a nightly job
that waits in silence cannot be told from one that hangs: every ``every_s`` seconds in which
some (model, queue) the batch sent jobs to has no live worker, ``WorkerWatch`` writes one line
naming the model, the queue and how to start a worker for it. It runs in a thread beside the
run (the runner's own thread blocks in the client's read while nothing finishes) and reads
only the queues' registries and heartbeats (``Client.live_workers``), once per interval.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable, Optional

from tokenrelay.producer_sdk.errors import RedisUnavailable

DEFAULT_EVERY_S = 10.0


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class WorkerWatch:
    """Remembers which (model, queue) the batch sends to (``sent``) and, while running (a
    context manager), reports each one without a live worker every ``every_s`` seconds."""

    def __init__(self, client: Any, every_s: float = DEFAULT_EVERY_S,
                 say: Callable[[str], None] = _stderr) -> None:
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0 seconds, got {every_s!r}")
        self.client, self.every_s, self.say = client, every_s, say
        self.routes: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._t0 = time.monotonic()

    def sent(self, model: str, queue: Optional[str]) -> None:
        """A line for ``model`` went to ``queue`` (None: the client's)."""
        with self._lock:
            self.routes.add((model, queue or self.client.queue))

    def __enter__(self) -> "WorkerWatch":
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="batch-worker-watch",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.check()

    def check(self) -> None:
        """One report: a line per (model, queue) without a live worker now."""
        with self._lock:
            routes = sorted(self.routes)
        waited = round(time.monotonic() - self._t0)
        for model, queue in routes:
            try:
                if self.client.live_workers(queue):
                    continue
            except RedisUnavailable as exc:
                self.say(f"batch: waiting ({waited} s): cannot reach Redis to see the workers "
                         f"of queue {queue!r}: {exc}")
                return
            self.say(f"batch: waiting ({waited} s): no live worker serves model {model!r} on "
                     f"queue {queue!r}; its lines wait until one starts (tokenrelay worker "
                     f"--queue {queue} --served-model-name {model} --model ...)")


__all__ = ["WorkerWatch", "DEFAULT_EVERY_S"]
