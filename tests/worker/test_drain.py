"""worker/drain.py: a draining worker reads nothing more, hands back what it read but did not
start (and its unread routed jobs) at once, lets running jobs run until --drain-timeout, then
parks them: handed back with their delivery count unchanged, their owner record released.
(A drain end to end, with another worker resuming, is in tests/worker/test_service.py.)"""

from __future__ import annotations

import pytest

from tokenrelay.protocol.keys import GROUP, PARKING_CONSUMER
from tests.fault_harness import check_stream, submit
from tests.worker.hand_driven import KEYS, hand_worker, iterate_until  # noqa: F401
from tokenrelay.worker.fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(60)


def test_at_the_deadline_running_jobs_are_parked_uncounted(hand_worker, redis_server):
    r = redis_server.client()
    w = hand_worker(engine=FakeEngine(), drain_timeout=0.0)
    entry_id = submit(r, KEYS, {"job_id": "long", "prompt": "p", "params": {"max_tokens": 500}})
    iterate_until(w, lambda: "long" in w.jobs and w.jobs["long"].tokens >= 3)
    w.stop()
    assert iterate_until(w, lambda: False) <= 10   # the loop says exit within a few iterations
    assert w.draining and not w.jobs and not w.engine.has_unfinished_requests()
    (row,) = r.xpending_range(KEYS.lane("default"), GROUP, "-", "+", 10)
    assert row["message_id"].decode() == entry_id
    assert (row["consumer"].decode(), row["times_delivered"]) == (PARKING_CONSUMER, 1)
    assert not r.exists(KEYS.owner("long")) and not check_stream(r, KEYS, "long").ended


def test_begin_hands_back_unstarted_entries_and_own_routed_jobs(hand_worker, redis_server):
    r = redis_server.client()
    w = hand_worker()
    c = w._crew()
    read = submit(r, KEYS, {"job_id": "read", "prompt": "p"})
    c.intake.prefetched = c.pending.read_new(1)               # read with the last flush
    r.xadd(KEYS.affinity("w1", 0), {"data": b"routed"})                    # unread, ours
    c.drain.begin(force=False)
    assert c.drain.active and c.intake.prefetched is None
    rows = {x["message_id"].decode(): x for x in
            r.xpending_range(KEYS.lane("default"), GROUP, "-", "+", 10)}
    assert rows[read]["consumer"].decode() == PARKING_CONSUMER
    # Only the read entry is pending: the routed one went back unread. (Not ``routed not in
    # rows``: two streams' XADDs in the same millisecond get the same id, so the routed
    # entry's id could name the read one; that made this test flaky.)
    assert r.xlen(KEYS.affinity("w1", 0)) == 0 and set(rows) == {read}
    assert [f[b"data"] for _, f in r.xrange(KEYS.lane("default"))][-1] == b"routed"
