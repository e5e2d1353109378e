"""The pending-list layer (worker/pending.py) and its scripts (protocol/scripts/pending.py)
against real redis-server processes, Redis 7 and 6.2 (tests/worker/redis_layer.py): reads,
reclaims, renewals, parks, releases, acks, each only of entries this consumer holds."""

from __future__ import annotations

import msgpack
import pytest

from tokenrelay.protocol.keys import GROUP, PARKING_CONSUMER
from tests.worker.redis_layer import age, enqueue, keeper, keys, pending, r, read_as  # noqa: F401
from tokenrelay.worker.pending import AckStatus, PendingList

pytestmark = pytest.mark.timeout(60)


def test_renew_resets_idle_without_counting_a_delivery(r, keys):
    lane = keys.lane("default")
    ids = [enqueue(r, keys, f"j{i}") for i in range(3)]
    read_as(r, keys, "a")
    age(r, lane, "a", ids, 5000)
    assert keeper(r, keys, "a").renew([(lane, i) for i in ids]) == []
    for i in ids:
        row = pending(r, lane, i)
        assert row["consumer"] == b"a"
        assert row["time_since_delivered"] < 1000
        assert row["times_delivered"] == 1


def test_renew_does_not_steal_back_a_reclaimed_entry(r, keys):
    lane = keys.lane("default")
    mine, theirs = enqueue(r, keys, "mine"), enqueue(r, keys, "theirs")
    read_as(r, keys, "a")
    age(r, lane, "a", [mine, theirs], 5000)
    assert [e.entry_id for e in keeper(r, keys, "b").reclaim(1)] == [mine]
    lost = keeper(r, keys, "a").renew([(lane, mine), (lane, theirs)])
    assert lost == [(lane, mine)]
    assert pending(r, lane, mine)["consumer"] == b"b"
    assert pending(r, lane, theirs)["consumer"] == b"a"


def test_renew_reports_acknowledged_entries_as_lost(r, keys):
    lane = keys.lane("default")
    eid = enqueue(r, keys, "j")
    read_as(r, keys, "a")
    r.xack(lane, GROUP, eid)
    assert keeper(r, keys, "a").renew([(lane, eid)]) == [(lane, eid)]


def test_reclaim_takes_only_expired_leases_most_urgent_first(r, keys):
    fresh = enqueue(r, keys, "fresh")
    bulk = enqueue(r, keys, "bulk", lane="bulk")
    urgent = enqueue(r, keys, "urgent", lane="urgent")
    for lane in ("default", "bulk", "urgent"):
        read_as(r, keys, "dead", lane=lane)
    age(r, keys.lane("bulk"), "dead", [bulk], 5000)
    age(r, keys.lane("urgent"), "dead", [urgent], 5000)
    got = keeper(r, keys, "b").reclaim(10)
    assert [(e.lane_key, e.entry_id) for e in got] == [(keys.lane("urgent"), urgent),
                                                      (keys.lane("bulk"), bulk)]
    assert all(e.deliveries == 2 and e.source == "reclaimed" for e in got)
    assert msgpack.unpackb(got[0].payload)["job_id"] == "urgent"
    assert pending(r, keys.lane("default"), fresh)["consumer"] == b"dead"
    assert pending(r, keys.lane("urgent"), urgent)["consumer"] == b"b"


def test_parked_entries_come_first_and_keep_their_delivery_count(r, keys):
    from tokenrelay.protocol.keys import PARKED_IDLE_MS, PARKING_CONSUMER
    lane = keys.lane("default")
    stale, parked = enqueue(r, keys, "stale"), enqueue(r, keys, "parked")
    read_as(r, keys, "dead")
    age(r, lane, "dead", [stale], 5000)
    r.xclaim(lane, GROUP, PARKING_CONSUMER, 0, [parked], idle=PARKED_IDLE_MS, retrycount=2,
             justid=True)
    got = keeper(r, keys, "b").reclaim(10)
    assert [(e.entry_id, e.deliveries) for e in got] == [(parked, 2), (stale, 2)]
    assert pending(r, lane, parked)["times_delivered"] == 2


def test_reclaim_follows_the_cursor_and_stops_at_count(r, keys):
    lane = keys.lane("default")
    ids = [enqueue(r, keys, f"j{i}") for i in range(25)]
    read_as(r, keys, "dead")
    # Leave holes of live entries between expired ones so the scan must go on past them.
    expired = ids[::2]
    age(r, lane, "dead", expired, 5000)
    k = keeper(r, keys, "b")
    first = k.reclaim(5)
    assert [e.entry_id for e in first] == expired[:5]
    rest = k.reclaim(100)
    assert [e.entry_id for e in rest] == expired[5:]
    assert k.reclaim(100) == []


def test_reclaim_counts_the_delivery_that_makes_a_job_poison(r, keys):
    lane = keys.lane("default")
    poison, ok = enqueue(r, keys, "poison", prompt="boom"), enqueue(r, keys, "ok")
    read_as(r, keys, "dead")
    age(r, lane, "dead", [poison], 5000, deliveries=3)   # reclaim makes it the 4th delivery
    age(r, lane, "dead", [ok], 5000, deliveries=2)       # ... and this one the 3rd
    got = keeper(r, keys, "b").reclaim(10)
    assert [(e.entry_id, e.deliveries) for e in got] == [(poison, 4), (ok, 3)]


def test_reclaim_returns_entries_whose_payload_was_deleted(r, keys):
    lane = keys.lane("default")
    gone, kept = enqueue(r, keys, "gone"), enqueue(r, keys, "kept")
    read_as(r, keys, "dead")
    age(r, lane, "dead", [gone, kept], 5000)
    r.xdel(lane, gone)
    k = keeper(r, keys, "b")
    got = k.reclaim(10)
    # Redis 7 drops a deleted entry from the pending list itself; 6.2 hands it over, body nil
    assert {(e.entry_id, e.fields is None) for e in got} == {(gone, True), (kept, False)}
    k.ack([(lane, gone)])                                  # what admission does with it
    assert pending(r, lane, gone) is None
    assert r.xpending(lane, GROUP)["pending"] == 1


def test_ack_refuses_entries_owned_by_someone_else(r, keys):
    lane = keys.lane("default")
    eid = enqueue(r, keys, "j")
    read_as(r, keys, "a")
    assert keeper(r, keys, "b").ack([(lane, eid)]) == [AckStatus.NOT_OWNER]
    assert pending(r, lane, eid)["consumer"] == b"a"
    assert keeper(r, keys, "a").ack([(lane, eid)]) == [AckStatus.ACKED]
    assert pending(r, lane, eid) is None and r.xlen(lane) == 0


def test_release_hands_back_counting_one_delivery(r, keys):
    lane = keys.lane("default")
    eid = enqueue(r, keys, "j")
    read_as(r, keys, "a")
    assert keeper(r, keys, "a").release([(lane, eid)]) == []
    row = pending(r, lane, eid)
    assert row["consumer"] == b"a" and row["times_delivered"] == 1
    assert row["time_since_delivered"] > 10**9
    (got,) = keeper(r, keys, "b").reclaim(10)
    assert got.entry_id == eid and got.deliveries == 2
    assert keeper(r, keys, "a").release([(lane, eid)]) == [(lane, eid)]   # not ours any more


def test_restore_counts_undoes_a_reconnect_re_read(r, keys):
    lane = keys.lane("default")
    eid = enqueue(r, keys, "j")
    read_as(r, keys, "a")
    r.xreadgroup(GROUP, "a", {lane: "0"})                         # re-read: count 2
    assert pending(r, lane, eid)["times_delivered"] == 2
    assert keeper(r, keys, "a").restore_counts([(lane, eid, 1)]) == []
    assert pending(r, lane, eid)["times_delivered"] == 1
    assert keeper(r, keys, "b").restore_counts([(lane, eid, 1)]) == [(lane, eid)]


def test_ack_checks_the_consumer_and_deletes(r, keys):
    lane = keys.lane("default")
    ids = [r.xadd(lane, {"data": b"x"}).decode() for _ in range(3)]
    r.xreadgroup(GROUP, "w1", {lane: ">"}, count=2)
    r.xreadgroup(GROUP, "w2", {lane: ">"}, count=1)
    p1 = PendingList(r, keys, "w1")
    assert p1.ack([(lane, i) for i in ids]) == [AckStatus.ACKED, AckStatus.ACKED,
                                                AckStatus.NOT_OWNER]
    assert r.xlen(lane) == 1  # acknowledged entries are deleted, w2's stays
    assert p1.ack([(lane, ids[0])]) == [AckStatus.NOT_PENDING]


def test_park_and_claim_parked_keep_delivery_count(r, keys):
    lane = keys.lane("default")
    ids = [r.xadd(lane, {"data": f"p{i}".encode()}).decode() for i in range(3)]
    r.xreadgroup(GROUP, "w1", {lane: ">"}, count=2)
    r.xreadgroup(GROUP, "other", {lane: ">"}, count=1)
    p1, p2 = PendingList(r, keys, "w1"), PendingList(r, keys, "w2")
    assert p1.park((lane, i) for i in ids) == [(lane, ids[2])]  # not w1's: untouched
    pend = {p["message_id"].decode(): p for p in r.xpending_range(lane, GROUP, "-", "+", 10)}
    assert pend[ids[0]]["consumer"].decode() == PARKING_CONSUMER
    assert pend[ids[0]]["time_since_delivered"] > 10**11 and pend[ids[0]]["times_delivered"] == 1
    assert pend[ids[2]]["consumer"] == b"other"
    got = p2.reclaim(10, None)
    assert [(e.entry_id, e.fields[b"data"], e.deliveries, e.source) for e in got] == [
        (ids[0], b"p0", 1, "parked"), (ids[1], b"p1", 1, "parked")]
    pend = {p["message_id"].decode(): p for p in r.xpending_range(lane, GROUP, "-", "+", 10)}
    assert pend[ids[0]]["consumer"] == b"w2" and pend[ids[0]]["times_delivered"] == 1
    assert pend[ids[2]]["consumer"] == b"other"


def test_read_own_pending_reports_deleted_entries_and_pages(r, keys):
    lane = keys.lane("default")
    ids = [r.xadd(lane, {"data": f"o{i}".encode()}).decode() for i in range(3)]
    r.xreadgroup(GROUP, "w1", {lane: ">"}, count=3)
    r.xdel(lane, ids[1])
    got = PendingList(r, keys, "w1").read_own_pending(page=2)
    assert [e.entry_id for e in got] == ids
    assert got[1].fields is None and got[0].payload == b"o0" and got[2].payload == b"o2"


def test_read_new_takes_urgent_first_up_to_count(r, keys):
    lane = keys.lane("default")
    for i in range(3):
        r.xadd(keys.lane("bulk"), {"data": f"b{i}".encode()})
        r.xadd(lane, {"data": f"d{i}".encode()})
    r.xadd(keys.lane("urgent"), {"data": b"u0"})
    got = PendingList(r, keys, "w1").read_new(4)
    assert [(e.lane, e.payload) for e in got] == [
        ("urgent", b"u0"), ("default", b"d0"), ("default", b"d1"), ("default", b"d2")]
