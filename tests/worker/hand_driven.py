"""A worker whose loop the test drives by hand: connected to a real redis-server and holding its
worker id, but with no thread, so nothing happens between two calls of ``_iteration`` (or of one
collaborator's method). For the seams between the loop and its collaborators: what one reports
and what the loop does about it."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

from tokenrelay.protocol.keys import Keys
from tests.fixtures_redis import FAST
from tokenrelay.worker.config import WorkerSettings
from tokenrelay.worker.fake_engine import FakeEngine
from tokenrelay.worker.service import Worker

KEYS = Keys()


@pytest.fixture
def hand_worker(redis_server) -> Iterator[Callable[..., Worker]]:
    """``hand_worker(engine=None, **settings)``: a connected Worker (id ``w1``); shut down at
    teardown."""
    made: list[Worker] = []

    def make(engine: Any = None, **overrides: Any) -> Worker:
        settings = WorkerSettings(**{"redis_url": redis_server.url, "worker_id": "w1",
                                     "model": "fake:", **FAST, **overrides})
        w = Worker(settings, engine=engine if engine is not None else FakeEngine())
        made.append(w)
        assert w._connect() and w._claim_worker_id()
        return w

    yield make
    for w in made:
        w._shutdown()


def iterate_until(w: Worker, done: Callable[[], bool], limit: int = 200) -> int:
    """Run loop iterations until ``done()`` (or the worker says exit); how many ran."""
    for n in range(1, limit + 1):
        exit_now = w._iteration()
        if done() or exit_now:
            return n
    raise AssertionError(f"not done after {limit} iterations")


def start_job(w: Worker, r: Any, job_id: str, max_tokens: int = 40,
              temperature: float = 0.0) -> None:
    """Submit a job and iterate until the worker runs it with 3 tokens made and nothing owed."""
    from tests.fault_harness import submit
    submit(r, KEYS, {"job_id": job_id, "prompt": job_id,
                     "params": {"max_tokens": max_tokens, "temperature": temperature}})
    iterate_until(w, lambda: job_id in w.jobs and w.jobs[job_id].tokens >= 3
                  and not w.jobs[job_id].pending)
