"""A job whose records Redis lost (it came back without its data) ends on the worker, and
nothing of it is recreated (issue #25): not by its next write, not by a resume of its entry.
Recreating its stream or dedupe record with a fresh sampling seed would start a second run
beside the one its readers enqueue again from the request they hold (producer_sdk/core/reads.py),
and a sampled output would mix two samples. Hand-driven, so each seam is deterministic; the
process-level scenario is in tests/faults/test_redis_restarts.py."""

from __future__ import annotations

import pytest

from tests.worker.hand_driven import KEYS, hand_worker, iterate_until, start_job  # noqa: F401
from tokenrelay.worker.fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(60)


def records(r, job_id: str) -> int:
    return r.exists(KEYS.results(job_id), KEYS.owner(job_id), KEYS.dedupe(job_id))


def start(w, r, job_id: str) -> None:
    start_job(w, r, job_id, temperature=0.7)       # sampled: a rerun would draw another seed


def test_the_next_write_ends_the_job_and_recreates_nothing(hand_worker, redis_server):
    r = redis_server.client()
    w = hand_worker(engine=FakeEngine())
    start(w, r, "s")
    r.flushall()                                   # Redis came back without its data
    w._crew().stepper.step()
    report = w._crew().outbox.flush([], None)
    assert "s" not in w.jobs and report.resume == [] and report.transient is None
    assert records(r, "s") == 0


def test_a_resumed_entry_redis_lost_is_not_run(hand_worker, redis_server):
    """A job dropped to resume (its stream looked behind) while Redis lost everything: its
    entry is gone from its lane, so admission touches nothing and does not run it."""
    r = redis_server.client()
    w = hand_worker(engine=FakeEngine())
    start(w, r, "s")
    entry = w.jobs["s"].entry
    w.jobs.drop(w.jobs["s"], "test: resume it")
    r.flushall()
    w._crew().intake.defer([entry])
    iterate_until(w, lambda: not w._crew().intake.deferred and not w.jobs.get("s"), limit=5)
    for _ in range(3):
        w._iteration()
    assert "s" not in w.jobs and not w.engine.has_unfinished_requests()
    assert records(r, "s") == 0
