"""worker/outbox.py: one flush ships what is owed and reports what the loop must act on
(``FlushReport``): a transient error (everything stays owed; the loop backs off and says so in
the heartbeat) and the jobs whose streams lost events (the loop resumes them from what the
stream holds)."""

from __future__ import annotations

import pytest

from tests.fault_harness import check_stream
from tests.worker.hand_driven import KEYS, hand_worker, iterate_until, start_job  # noqa: F401
from tokenrelay.worker.fake_engine import FakeEngine, fake_completion

pytestmark = pytest.mark.timeout(60)


def test_a_transient_error_keeps_everything_owed_and_pauses_the_loop(hand_worker, redis_server):
    r = redis_server.client()
    w = hand_worker(engine=FakeEngine())
    start_job(w, r, "j")
    outbox, job = w._crew().outbox, w.jobs["j"]
    w._crew().stepper.step()
    owed = list(job.pending)
    r.config_set("maxmemory", 1)                   # every write: OOM, a transient error
    try:
        report = outbox.flush([], None)
        assert report.transient and "OOM" in report.transient and report.permanent is None
        assert job.pending == owed                  # nothing dropped, nothing counted
        w._on_flush(report)                         # backs off (and waits) before going on
        assert w.redis_error == report.transient and w.backoff.failures == 1
        assert w.status().redis_error == report.transient
    finally:
        r.config_set("maxmemory", 0)
    report = outbox.flush([], None)
    assert report.transient is None and not job.pending
    w._on_flush(report)
    assert w.redis_error is None and w.backoff.failures == 0


def test_a_stream_that_lost_events_is_resumed_from_what_it_holds(hand_worker, redis_server):
    r = redis_server.client()
    w = hand_worker(engine=FakeEngine())
    start_job(w, r, "lost", max_tokens=12)
    entry = w.jobs["lost"].entry
    stream = KEYS.results("lost")
    last = r.xrevrange(stream, count=1)[0][0]
    r.xdel(stream, last)      # a restart lost the last acknowledged write; no error was seen
    w._crew().stepper.step()
    report = w._crew().outbox.flush([], None)
    assert report.resume == [entry] and report.transient is None
    assert "lost" not in w.jobs                     # dropped: it restarts from the stream
    w._on_flush(report)
    assert w._crew().intake.deferred == report.resume
    iterate_until(w, lambda: check_stream(r, KEYS, "lost").ended)
    rep = check_stream(r, KEYS, "lost")
    assert rep.problems == [] and rep.text == fake_completion("lost", 12)
    assert [s.attempt for s in rep.started] == [1, 2]
