"""FairCompileQueue's rules, with tasks that block on events instead of compiling: owners take
turns, no owner runs more than its cap, cancelled tasks never run, close cancels the rest."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError, Future
from typing import Callable

import pytest

from tokenrelay.engine.compile_queue import (CompileQueueClosed, FairCompileQueue,
                                             default_per_owner)

pytestmark = pytest.mark.timeout(30)


class Recorder:
    """Tasks that record their start and wait for their own release."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.gates: dict[str, threading.Event] = {}
        self._cond = threading.Condition()

    def task(self, name: str) -> Callable[[], str]:
        self.gates[name] = threading.Event()

        def run() -> str:
            with self._cond:
                self.started.append(name)
                self._cond.notify_all()
            assert self.gates[name].wait(10), f"{name} was never released"
            return name
        return run

    def wait_started(self, count: int) -> list[str]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.started) >= count, 10), self.started
            return list(self.started)


def submit(q: FairCompileQueue, rec: Recorder, owner: str, name: str) -> "Future[str]":
    return q.submit(owner, rec.task(name))


def one_thread_busy(name: str) -> tuple[FairCompileQueue, Recorder, "Future[str]"]:
    """A one-thread queue whose thread runs A's task ``name`` until its gate is set."""
    q, rec = FairCompileQueue(threads=1), Recorder()
    busy = submit(q, rec, "A", name)
    rec.wait_started(1)
    return q, rec, busy


def test_owners_take_turns_and_a_newcomer_runs_next():
    q, rec = FairCompileQueue(threads=1), Recorder()
    futures = [submit(q, rec, "A", f"a{i}") for i in range(4)]
    assert rec.wait_started(1) == ["a0"]
    futures += [submit(q, rec, "B", "b0"), submit(q, rec, "C", "c0"),
                submit(q, rec, "B", "b1")]
    for k, name in enumerate(["a0", "b0", "c0", "a1", "b1", "a2", "a3"]):
        assert rec.wait_started(k + 1)[-1] == name
        rec.gates[name].set()
    assert sorted(f.result(5) for f in futures) == sorted(rec.gates)
    q.close()


def test_an_owner_runs_at_most_its_cap_and_leaves_the_other_threads_free():
    q, rec = FairCompileQueue(threads=4), Recorder()
    assert q.per_owner == default_per_owner(4) == 2
    a = [submit(q, rec, "A", f"a{i}") for i in range(6)]
    assert sorted(rec.wait_started(2)) == ["a0", "a1"]
    b = [submit(q, rec, "B", f"b{i}") for i in range(2)]
    assert sorted(rec.wait_started(4)[2:]) == ["b0", "b1"]   # A's backlog did not take them
    assert q.running() == {"A": 2, "B": 2} and q.queued() == 4
    for g in rec.gates.values():
        g.set()
    assert [f.result(5) for f in a + b] == [f"a{i}" for i in range(6)] + ["b0", "b1"]
    q.close()


def test_a_cancelled_task_never_runs_and_exceptions_reach_the_future():
    q, rec, first = one_thread_busy("first")
    dropped = submit(q, rec, "A", "dropped")
    failing = q.submit(None, lambda: 1 / 0)
    assert dropped.cancel()
    rec.gates["first"].set()
    with pytest.raises(ZeroDivisionError):
        failing.result(5)
    assert first.result(5) == "first" and rec.started == ["first"]
    q.close()


def test_close_cancels_what_waits_and_refuses_new_tasks():
    q, rec, running = one_thread_busy("running")
    waiting = submit(q, rec, "B", "waiting")
    q.close()
    with pytest.raises(CancelledError):
        waiting.result(5)
    rec.gates["running"].set()
    assert running.result(5) == "running"
    with pytest.raises(CompileQueueClosed):
        q.submit("A", lambda: None)


@pytest.mark.parametrize("threads, per_owner", [(0, None), (2, 0), (2, 3)])
def test_bad_sizes_are_refused(threads, per_owner):
    with pytest.raises(ValueError):
        FairCompileQueue(threads, per_owner)


def test_the_books_forget_owners_with_nothing_left():
    """Producer ids come from the wire: 500 one-off owners leave nothing behind."""
    q = FairCompileQueue(threads=2)
    futures = [q.submit(f"owner-{i}", lambda i=i: i) for i in range(500)]
    assert [f.result(5) for f in futures] == list(range(500))
    deadline = time.monotonic() + 5       # a thread settles its books just after the result
    while q.running() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert q.running() == {} and q.queued() == 0
    assert not q._running and not q._last_turn and not q._pending
    q.close()
