"""Fencing and pending-list primitives (worker/fencing.py) against a real redis-server."""

from __future__ import annotations

import pytest

from producer_sdk.protocol import GROUP, PARKING_CONSUMER, Keys
from worker.fencing import (AckStatus, Fence, ScriptPipeline, WriteStatus, parse_ack_codes,
                            parse_raw_entries, parse_step_reply, parse_write_status)

K = Keys()
LANE = K.lane("default")


@pytest.fixture
def r(redis_server):
    c = redis_server.client()
    c.xgroup_create(LANE, GROUP, id="0", mkstream=True)
    yield c
    c.close()


def run(r, build):
    pipe = ScriptPipeline(r)
    build(pipe)
    return pipe.execute()


def write(r, fence, owner, batch, events, create=True, ttl=60_000, job="j"):
    (res,) = run(r, lambda p: fence.write_events(p, job, owner, ttl, batch, events, create))
    return parse_write_status(res)


def test_write_requires_ownership_and_sets_ttl(r):
    f = Fence(K, "w1")
    assert write(r, f, "w1:a", "a.0", [b"e1"]) is WriteStatus.MISSING
    run(r, lambda p: f.take_ownership(p, "j", "w1:a", 60_000))
    assert write(r, f, "w1:a", "a.0", [b"e1", b"e2"]) is WriteStatus.OK
    assert 0 < r.pttl(K.results("j")) <= 60_000
    run(r, lambda p: f.take_ownership(p, "j", "w2:b", 60_000))  # takeover
    assert write(r, f, "w1:a", "a.1", [b"late"], create=False) is WriteStatus.REFUSED
    assert [x[1][b"data"] for x in r.xrange(K.results("j"))] == [b"e1", b"e2"]


def test_retried_batch_is_idempotent_and_completes_a_partial_one(r):
    f = Fence(K, "w1")
    run(r, lambda p: f.take_ownership(p, "j", "w1:a", 60_000))
    assert write(r, f, "w1:a", "a.0", [b"s", b"t0"]) is WriteStatus.OK
    assert write(r, f, "w1:a", "a.0", [b"s", b"t0"]) is WriteStatus.DUP
    # a batch that died half way: only its first event landed
    r.xadd(K.results("j"), {"data": b"t1", "b": b"a.1:1"})
    assert write(r, f, "w1:a", "a.1", [b"t1", b"t2", b"done"], create=False) is WriteStatus.OK
    assert [x[1][b"data"] for x in r.xrange(K.results("j"))] == [b"s", b"t0", b"t1", b"t2",
                                                                  b"done"]


def test_expired_stream_is_never_recreated(r):
    f = Fence(K, "w1")
    run(r, lambda p: f.take_ownership(p, "j", "w1:a", 60_000))
    assert write(r, f, "w1:a", "a.0", [b"s"]) is WriteStatus.OK
    r.delete(K.results("j"))  # expired
    assert write(r, f, "w1:a", "a.1", [b"t"], create=False) is WriteStatus.GONE
    assert not r.exists(K.results("j"))
    r.delete(K.owner("j"))
    assert write(r, f, "w1:a", "a.1", [b"t"], create=False) is WriteStatus.MISSING


def test_ack_checks_the_consumer_and_deletes(r):
    ids = [r.xadd(LANE, {"data": b"x"}).decode() for _ in range(3)]
    r.xreadgroup(GROUP, "w1", {LANE: ">"}, count=2)
    r.xreadgroup(GROUP, "w2", {LANE: ">"}, count=1)
    f1 = Fence(K, "w1")
    (res,) = run(r, lambda p: f1.ack(p, LANE, ids))
    assert parse_ack_codes(res) == [AckStatus.ACKED, AckStatus.ACKED, AckStatus.NOT_OWNER]
    assert r.xlen(LANE) == 1  # acknowledged entries are deleted, w2's stays
    (res,) = run(r, lambda p: f1.ack(p, LANE, ids[:1]))
    assert parse_ack_codes(res) == [AckStatus.NOT_PENDING]


def test_park_and_claim_parked_keep_delivery_count(r):
    ids = [r.xadd(LANE, {"data": f"p{i}".encode()}).decode() for i in range(3)]
    r.xreadgroup(GROUP, "w1", {LANE: ">"}, count=2)
    r.xreadgroup(GROUP, "other", {LANE: ">"}, count=1)
    f1, f2 = Fence(K, "w1"), Fence(K, "w2")
    (n,) = run(r, lambda p: f1.park(p, LANE, ids))  # ids[2] is not w1's: untouched
    assert n == 2
    pend = {p["message_id"].decode(): p for p in r.xpending_range(LANE, GROUP, "-", "+", 10)}
    assert pend[ids[0]]["consumer"].decode() == PARKING_CONSUMER
    assert pend[ids[0]]["time_since_delivered"] > 10**11 and pend[ids[0]]["times_delivered"] == 1
    assert pend[ids[2]]["consumer"] == b"other"
    (rows,) = run(r, lambda p: f2.claim_parked(p, LANE, 10))
    got = parse_raw_entries(rows)
    assert [(i, f[b"data"], d) for i, f, d in got] == [(ids[0], b"p0", 1), (ids[1], b"p1", 1)]
    pend = {p["message_id"].decode(): p for p in r.xpending_range(LANE, GROUP, "-", "+", 10)}
    assert pend[ids[0]]["consumer"] == b"w2" and pend[ids[0]]["times_delivered"] == 1
    assert pend[ids[2]]["consumer"] == b"other"


def test_read_own_pending_reports_deleted_entries(r):
    ids = [r.xadd(LANE, {"data": f"o{i}".encode()}).decode() for i in range(3)]
    r.xreadgroup(GROUP, "w1", {LANE: ">"}, count=3)
    r.xdel(LANE, ids[1])
    f = Fence(K, "w1")
    (rows,) = run(r, lambda p: f.read_own_pending(p, LANE, "0", 10))
    got = parse_raw_entries(rows)
    assert [g[0] for g in got] == ids
    assert got[1][1] is None and got[0][1][b"data"] == b"o0"
    (rows,) = run(r, lambda p: f.read_own_pending(p, LANE, ids[1], 10))  # paging
    assert [g[0] for g in parse_raw_entries(rows)] == [ids[2]]


def test_renew_never_steals_a_reclaimed_entry(r):
    eid = r.xadd(LANE, {"data": b"x"}).decode()
    r.xreadgroup(GROUP, "w1", {LANE: ">"}, count=1)
    r.xclaim(LANE, GROUP, "w2", 0, [eid], justid=True)
    (n,) = run(r, lambda p: Fence(K, "w1").renew(p, LANE, [eid]))
    assert n == 0
    assert r.xpending_range(LANE, GROUP, "-", "+", 1)[0]["consumer"] == b"w2"


def test_scripts_survive_a_script_cache_flush(r):
    f = Fence(K, "w1")
    run(r, lambda p: f.take_ownership(p, "j", "w1:a", 60_000))
    r.script_flush()
    assert write(r, f, "w1:a", "a.0", [b"x"]) is WriteStatus.OK


def test_write_step_isolates_jobs_and_reads_cancel_flags(r):
    f = Fence(K, "w1")
    for j in ("a", "b", "c"):
        run(r, lambda p, j=j: f.take_ownership(p, j, f"w1:{j}", 60_000))
    r.set(K.results("b"), "not a stream")          # a broken key must not fail a or c
    r.set(K.cancel("c"), 1)
    (reply,) = run(r, lambda p: f.write_step(p, 60_000, [
        ("a", "w1:a", "a.0", [b"a1", b"a2"], True, False, False),
        ("b", "w1:b", "b.0", [b"b1"], True, False, False),
        ("c", "w1:c", "c.0", [], True, False, False),
        ("d", "w1:d", "d.0", [b"d1"], True, False, False)]))   # no owner record
    got = [(st, cancel) for st, cancel, _ in parse_step_reply(reply)]
    assert got == [(WriteStatus.OK, False), (WriteStatus.ERROR, False),
                   (WriteStatus.SKIP, True), (WriteStatus.MISSING, False)]
    assert "WRONGTYPE" in parse_step_reply(reply)[1][2]
    assert [x[1][b"data"] for x in r.xrange(K.results("a"))] == [b"a1", b"a2"]
    # a retry of a's batch after a lost reply (check=1) adds nothing; without create the
    # expired stream of another job is not recreated
    r.delete(K.results("c"))
    (reply,) = run(r, lambda p: f.write_step(p, 60_000, [
        ("a", "w1:a", "a.0", [b"a1", b"a2"], False, True, False),
        ("c", "w1:c", "c.1", [b"c1"], False, False, False)]))
    assert [st for st, _, _ in parse_step_reply(reply)] == [WriteStatus.DUP, WriteStatus.GONE]
    assert r.xlen(K.results("a")) == 2 and not r.exists(K.results("c"))
    assert not r.exists(K.results("c")) and not r.exists(K.results("d"))


def test_write_step_sets_ttls_on_create_and_refresh_only(r):
    """Step writes leave the TTLs alone unless the stream is created or the worker asks for a
    refresh; whichever way, a result stream never exists without a TTL."""
    f = Fence(K, "w1")
    run(r, lambda p: f.take_ownership(p, "a", "w1:a", 60_000))
    run(r, lambda p: f.write_step(p, 60_000, [("a", "w1:a", "a.0", [b"a1"], True, False, False)]))
    assert 0 < r.pttl(K.results("a")) <= 60_000
    r.pexpire(K.results("a"), 5_000)
    r.pexpire(K.owner("a"), 5_000)
    run(r, lambda p: f.write_step(p, 60_000, [("a", "w1:a", "a.1", [b"a2"], False, False, False)]))
    assert r.pttl(K.results("a")) <= 5_000 and r.pttl(K.owner("a")) <= 5_000
    run(r, lambda p: f.write_step(p, 60_000, [("a", "w1:a", "a.2", [b"a3"], False, False, True)]))
    assert r.pttl(K.results("a")) > 5_000 and r.pttl(K.owner("a")) > 5_000
    assert r.xlen(K.results("a")) == 3


def test_read_new_takes_urgent_first_up_to_count(r):
    for name in K.LANES:
        r.xgroup_create(K.lane(name), GROUP, id="0", mkstream=True) if name != "default" else None
    for i in range(3):
        r.xadd(K.lane("bulk"), {"data": f"b{i}".encode()})
        r.xadd(LANE, {"data": f"d{i}".encode()})
    r.xadd(K.lane("urgent"), {"data": b"u0"})
    (rows,) = run(r, lambda p: Fence(K, "w1").read_new(p, K.lanes(), 4))
    assert [(int(i), dict(zip(f[::2], f[1::2]))[b"data"]) for i, _, f in rows] == [
        (1, b"u0"), (2, b"d0"), (2, b"d1"), (2, b"d2")]
