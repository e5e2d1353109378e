"""The grammar compile threads, shared fairly among the producers whose jobs wait on them.

Why not a plain thread pool: a pool is first come, first served, so one producer that sends
40 slow-to-compile constraints ahead of everyone else holds every compile thread until its
backlog is through, and every other producer's constrained job waits behind it (issue #42: a
benign job's first token went from 259 ms to 13 s). Here each task belongs to an *owner* (the
job's ``producer`` field; jobs without one share the anonymous owner ``""``) and:

- owners take turns: a free thread takes the oldest task of the owner whose last turn is the
  longest ago (an owner new to the queue first), so a newcomer's task runs next, and after
  that it waits at most one task per other owner, never their whole backlogs;
- no owner runs more than ``per_owner`` tasks at once (default half the threads, at least
  one), so while one owner's compiles run, other owners still find a free thread. The cap
  holds even when the pool is otherwise idle: a compile can run for seconds and cannot be
  interrupted, so threads lent to one owner's backlog would not be free when another owner
  arrives. Cached specs skip this queue's cost in practice (their task takes microseconds).

A task whose future was cancelled before it started (its request aborted or timed out) is
dropped unrun. Threads start on the first task and are daemons: a compile that never ends
cannot keep the process alive.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Optional

ANONYMOUS = ""


def default_per_owner(threads: int) -> int:
    """Half the threads (at least one): the other half stays free for other owners."""
    return max(1, threads // 2)


@dataclass
class _Task:
    owner: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: "Future[Any]"


class CompileQueueClosed(RuntimeError):
    """A task was submitted after ``close()`` (the engine is shutting down)."""


class FairCompileQueue:
    """Round-robin across owners, at most ``per_owner`` running tasks per owner, on
    ``threads`` threads (see the module docstring)."""

    def __init__(self, threads: int, per_owner: Optional[int] = None,
                 name: str = "grammar") -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        cap = default_per_owner(threads) if per_owner is None else per_owner
        if not 1 <= cap <= threads:
            raise ValueError(f"per_owner must be 1..{threads} (the threads), got {cap}")
        self.threads = threads
        self.per_owner = cap
        self.name = name
        self._cond = threading.Condition()
        self._pending: dict[str, deque[_Task]] = {}
        self._running: dict[str, int] = {}
        self._last_turn: dict[str, int] = {}    # owners with tasks queued or running only
        self._turns = itertools.count()
        self._workers: list[threading.Thread] = []
        self._closed = False

    def submit(self, owner: Optional[str], fn: Callable[..., Any], *args: Any) -> "Future[Any]":
        """Queue ``fn(*args)`` for ``owner`` (None: the anonymous owner); its future."""
        task = _Task(owner or ANONYMOUS, fn, args, Future())
        with self._cond:
            if self._closed:
                raise CompileQueueClosed("the grammar compile queue is closed (engine shut down)")
            self._pending.setdefault(task.owner, deque()).append(task)
            self._start_worker()
            self._cond.notify()
        return task.future

    def queued(self) -> int:
        """Tasks not started yet (cancelled ones not yet dropped included)."""
        with self._cond:
            return sum(len(q) for q in self._pending.values())

    def running(self) -> dict[str, int]:
        """Running tasks per owner (owners with none left out)."""
        with self._cond:
            return {o: n for o, n in self._running.items() if n}

    def close(self) -> None:
        """Cancel every task not started; running ones finish on their own (their threads
        then exit)."""
        with self._cond:
            self._closed = True
            tasks = [t for q in self._pending.values() for t in q]
            self._pending.clear()
            self._cond.notify_all()
        for t in tasks:
            t.future.cancel()

    # -- on the threads ----------------------------------------------------------------------
    def _start_worker(self) -> None:
        """One more thread while fewer than ``threads`` run (under the lock)."""
        if len(self._workers) < self.threads:
            t = threading.Thread(target=self._work, name=f"{self.name}-{len(self._workers)}",
                                 daemon=True)
            self._workers.append(t)
            t.start()

    def _work(self) -> None:
        while True:
            task = self._take()
            if task is None:
                return
            try:
                task.future.set_result(task.fn(*task.args))
            except BaseException as exc:  # the future carries it to the engine's thread
                task.future.set_exception(exc)
            finally:
                with self._cond:
                    self._finished(task.owner)
                    self._cond.notify_all()

    def _take(self) -> Optional[_Task]:
        """Wait for the next runnable task and mark it running; None once closed."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                task = self._next()
                if task is not None:
                    self._running[task.owner] = self._running.get(task.owner, 0) + 1
                    return task
                self._cond.wait()

    def _next(self) -> Optional[_Task]:
        """The oldest live task of the owner under its cap whose last turn is the longest ago
        (under the lock). Cancelled tasks met on the way are dropped."""
        while True:
            ready = [o for o in self._pending if self._running.get(o, 0) < self.per_owner]
            if not ready:
                return None
            owner = min(ready, key=lambda o: self._last_turn.get(o, -1))
            queue = self._pending[owner]
            task = queue.popleft()
            if not queue:
                del self._pending[owner]
            if task.future.set_running_or_notify_cancel():
                self._last_turn[owner] = next(self._turns)
                return task
            self._forget_if_idle(owner)

    def _finished(self, owner: str) -> None:
        """One of ``owner``'s tasks ended (under the lock)."""
        self._running[owner] -= 1
        self._forget_if_idle(owner)

    def _forget_if_idle(self, owner: str) -> None:
        """Drop the books of an owner with nothing queued or running: producer ids come from
        the wire, so keeping every one ever seen would grow without bound."""
        if owner not in self._pending and not self._running.get(owner):
            self._running.pop(owner, None)
            self._last_turn.pop(owner, None)
