"""worker/intake.py: what the worker reads next. Reads that bring more than the engine can start
keep the most urgent and hand the rest back (parked, their delivery count unchanged) on the
next flush; after a (re)connect the own pending list comes first."""

from __future__ import annotations

import pytest

from tokenrelay.protocol.keys import GROUP, PARKING_CONSUMER
from tests.fault_harness import submit
from tests.worker.hand_driven import KEYS, hand_worker  # noqa: F401

pytestmark = pytest.mark.timeout(60)


def add(r, job_id: str, priority: int = 0) -> str:
    return submit(r, KEYS, {"job_id": job_id, "prompt": job_id, "priority": priority,
                            "params": {"max_tokens": 2}})


def holders(r, lane: str) -> dict[str, tuple[str, int]]:
    return {row["message_id"].decode(): (row["consumer"].decode(), row["times_delivered"])
            for row in r.xpending_range(KEYS.lane(lane), GROUP, "-", "+", 10)}


def test_a_read_past_capacity_keeps_the_most_urgent_and_parks_the_rest(hand_worker,
                                                                       redis_server):
    r = redis_server.client()
    c = hand_worker()._crew()
    bulk, default, urgent = add(r, "b", 5), add(r, "d"), add(r, "u", -5)
    kept = c.intake.fit(c.pending.read_new(3), 1)
    assert [e.entry_id for e in kept] == [urgent]
    assert {e.entry_id for e in c.intake.surplus} == {bulk, default}
    assert set(c.intake.held()) >= {e.key for e in c.intake.surplus}
    c.outbox.flush([c.intake.surplus_rider], None)
    assert c.intake.surplus == []
    assert holders(r, "default")[default] == (PARKING_CONSUMER, 1)
    assert holders(r, "bulk")[bulk] == (PARKING_CONSUMER, 1)
    again = c.pending.read_new(5)                  # the next read anywhere takes them first
    assert [(e.entry_id, e.source, e.deliveries) for e in again] == [
        (default, "parked", 1), (bulk, "parked", 1)]


def test_after_a_reconnect_the_own_pending_list_comes_first(hand_worker, redis_server):
    r = redis_server.client()
    c = hand_worker()._crew()
    mine = add(r, "mine")
    r.xreadgroup(GROUP, "w1", {KEYS.lane("default"): ">"})   # read by a read whose reply was lost
    add(r, "new")
    c.intake.reread_own_pending()
    got = c.intake.collect(block=False)
    assert [(e.entry_id, e.source) for e in got] == [(mine, "pending")]
    assert [e.source for e in c.intake.collect(block=False)] == ["new"]
