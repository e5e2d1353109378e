"""The writer stage: the flush of step N runs on its own thread while the loop's thread runs
engine step N+1 (worker/service.py, ``_overlapped``).

Why a thread: on a GPU a decode step is 5-15 ms, and the worker's own work per step (turning
deltas into events, one Redis round trip, the replies, metrics) done in series with it would
cost a third of the GPU. A step spends its time in a GPU sync (or, in the fake engine, a sleep),
which releases the GIL, so a second thread can build and ship events meanwhile.

Why strictly one job at a time, started and awaited by the loop: the bound IS the
back-pressure. The loop starts the next step only after the flush it overlapped has landed, so
at most one step's events are ever in flight; when Redis is slower than the engine, the engine
waits. And while a flush runs, the loop's thread does nothing but the engine step: the two
threads never touch the same state (jobs, the outbox, the Redis client) at the same time, and
the engine is only ever called from the loop's thread (aborts wait for the step's end,
``JobTable.stepping``).
"""

from __future__ import annotations

import threading
from typing import Callable, Generic, Optional, TypeVar

T = TypeVar("T")


class WriterBusy(RuntimeError):
    """A second flush was started before the first was awaited: a bug in the loop."""


class Writer(Generic[T]):
    """One background thread that runs one job (a flush) at a time; see the module docstring.

    ``open`` starts the thread (``Worker.run`` does; a worker driven by hand never opens it and
    flushes in series), ``start`` hands it a job, ``wait`` returns the job's result or raises
    what it raised, in the caller's thread."""

    def __init__(self, name: str = "writer") -> None:
        self.name = name
        self._thread: Optional[threading.Thread] = None
        self._cv = threading.Condition()
        self._job: Optional[Callable[[], T]] = None
        self._busy = False
        self._result: Optional[T] = None
        self._error: Optional[BaseException] = None
        self._closing = False

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def open(self) -> None:
        if self.running:
            return
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
        self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the thread once its job (if any) is done."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = None

    def start(self, job: Callable[[], T]) -> None:
        with self._cv:
            if self._busy:
                raise WriterBusy("a flush is already in flight: wait() for it first")
            self._job, self._busy, self._result, self._error = job, True, None, None
            self._cv.notify_all()

    def wait(self) -> T:
        """The job's result (its exception re-raised here)."""
        with self._cv:
            while self._busy:
                self._cv.wait()
            error, result = self._error, self._result
            self._error = self._result = None
        if error is not None:
            raise error
        return result  # type: ignore[return-value]

    def _serve(self) -> None:
        while True:
            with self._cv:
                while self._job is None and not self._closing:
                    self._cv.wait()
                if self._job is None:
                    return
                job, self._job = self._job, None
            result: Optional[T] = None
            error: Optional[BaseException] = None
            try:
                result = job()
            except BaseException as exc:  # handed to the loop's thread, raised there
                error = exc
            with self._cv:
                self._result, self._error, self._busy = result, error, False
                self._cv.notify_all()
