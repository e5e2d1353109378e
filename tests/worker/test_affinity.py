"""Prefix-affinity routing with real workers (in-process, FakeEngine) on a real redis-server:
a routing key keeps a conversation on one worker, keys spread over the workers, jobs without a
key use the shared lanes as before; a draining worker's routed jobs go elsewhere; past the
backlog bound keyed jobs take the shared lane; and the sweep script moves exactly what nobody
holds. Killing a worker process is in tests/faults/test_affinity.py."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tokenrelay.producer_sdk import Client
from tokenrelay.producer_sdk.core.affinity import rank
from tokenrelay.protocol.keys import (GROUP, Keys, PARKED_IDLE_MS, PARKING_CONSUMER, PAYLOAD_FIELD,
                           dedupe_record, parse_dedupe_record)
from tokenrelay.protocol.wire import JobRequest, encode_job
from tests.fault_harness import check_stream, read_events, wait_all_ended, wait_for
from tokenrelay.protocol.limits import Limits
from tokenrelay.worker.affinity import Affinity
from tokenrelay.worker.fake_engine import FakeEngine
from tokenrelay.worker.logs import RateLimitedLog, get_logger
from tokenrelay.worker.pending import PendingList

pytestmark = pytest.mark.timeout(120)

KEYS = Keys()


def record_lane(r, job_id: str) -> str:
    return parse_dedupe_record(r.get(KEYS.dedupe(job_id)))[0]


def started_on(r, job_id: str) -> list[str]:
    """The worker of every ``started`` event of a job, in order."""
    return [e.worker_id for e in read_events(r, KEYS, job_id) if e.type == "started"]


def ended_once(r, job_ids: list[str], timeout: float = 30) -> None:
    reports = wait_all_ended(r, KEYS, job_ids, timeout)
    bad = {j: rep.problems for j, rep in reports.items() if rep.problems}
    assert not bad, bad
    assert all(rep.kind.startswith("done") for rep in reports.values())


def keys_for(first: str, workers: list[str], n: int, prefix: str = "conv") -> list[str]:
    """``n`` routing keys that rendezvous hashing gives to ``first``."""
    out = [f"{prefix}-{i}" for i in range(1000) if rank(f"{prefix}-{i}", workers)[0] == first]
    return out[:n]


# ------------------------------------------------------------------------------------------
# routing
# ------------------------------------------------------------------------------------------

def test_same_key_same_worker_and_keys_spread_and_no_key_is_shared(redis_server, start_worker):
    start_worker(worker_id="w1")
    start_worker(worker_id="w2")
    r = redis_server.client()
    convs = [f"conv-{i}" for i in range(8)]
    home = {k: rank(k, ["w1", "w2"])[0] for k in convs}
    assert set(home.values()) == {"w1", "w2"}       # the keys chosen cover both workers
    with Client(redis_server.url) as c:
        turns: dict[str, list[str]] = {k: [] for k in convs}
        for turn in range(3):                        # turn n+1 is sent once turn n is done
            jobs = [c.submit(f"{k} turn {turn}", routing_key=k, max_tokens=3) for k in convs]
            for k, job in zip(convs, jobs):
                job.result(timeout=20)
                turns[k].append(job.id)
        plain = [c.submit(f"plain {i}", max_tokens=3) for i in range(8)]
        for job in plain:
            job.result(timeout=20)
    for k, ids in turns.items():
        assert [started_on(r, j) for j in ids] == [[home[k]]] * 3, k
        assert {record_lane(r, j) for j in ids} == {KEYS.affinity(home[k], 0)}
    assert {record_lane(r, j.id) for j in plain} == {KEYS.lane("default")}
    assert {w for j in plain for w in started_on(r, j.id)} <= {"w1", "w2"}


def test_past_the_backlog_bound_keyed_jobs_take_the_shared_lane(redis_server, start_worker):
    start_worker(FakeEngine(max_num_seqs=1, step_delay=0.01), worker_id="w1")
    r = redis_server.client()
    with Client(redis_server.url, affinity_max_backlog=3) as c:
        jobs = c.submit_many([{"prompt": f"p{i}", "routing_key": "hot"} for i in range(6)],
                             max_tokens=4)
        ended_once(r, [j.id for j in jobs])
    lanes = [record_lane(r, j.id) for j in jobs]
    assert lanes == [KEYS.affinity("w1", 0)] * 3 + [KEYS.lane("default")] * 3


def test_a_draining_worker_gets_no_new_turns_and_its_queued_ones_move(redis_server,
                                                                      start_worker):
    slow = FakeEngine(max_num_seqs=1, step_delay=0.05)
    first = start_worker(slow, worker_id="w1", drain_timeout=10.0)
    start_worker(worker_id="w2")
    r = redis_server.client()
    key = keys_for("w1", ["w1", "w2"], 1)[0]
    with Client(redis_server.url, affinity_ttl_s=0) as c:
        queued = c.submit_many([{"prompt": f"t{i}", "routing_key": key} for i in range(5)],
                               max_tokens=10)
        ids = [j.id for j in queued]
        wait_for(lambda: started_on(r, ids[0]), 10, what="turn 1 running on w1")
        first.worker.stop()              # drain: the running turn finishes, the rest move
        wait_for(lambda: r.hget(KEYS.heartbeat("w1"), "draining") == b"1", 10,
                 what="w1 beating draining=1")
        late = c.submit("a new turn", routing_key=key, max_tokens=3)
        assert record_lane(r, late.id) == KEYS.affinity("w2", 0)
        ended_once(r, ids + [late.id])
    assert started_on(r, ids[0]) == ["w1"]
    assert all(started_on(r, j) == ["w2"] for j in ids[1:] + [late.id])
    assert all(record_lane(r, j) == KEYS.lane("default") for j in ids[1:])
    assert first.stop() == 0
    assert not r.exists(KEYS.affinity("w1", 0))          # emptied and deleted at exit
    assert r.zscore(KEYS.workers, "w1") is None           # so it left the registry


# ------------------------------------------------------------------------------------------
# the sweep, step by step
# ------------------------------------------------------------------------------------------

def sweeper(redis_server, worker_id: str = "sweeper") -> Affinity:
    """A worker's Affinity, with its pending list, and no worker loop: its sweep and reclaim
    are called by hand."""
    client = redis_server.client()
    pending = PendingList(client, KEYS, worker_id)
    pending.ensure_groups()
    log = get_logger(worker_id=worker_id)
    return Affinity(client, KEYS, worker_id, pending, Limits(), log, RateLimitedLog(log))


def add(r, stream: str, job_id: str, priority: int = 0, record: Any = True) -> str:
    raw = encode_job(JobRequest(job_id=job_id, prompt="p", priority=priority))
    entry_id = r.xadd(stream, {PAYLOAD_FIELD: raw}).decode()
    if record is True:
        r.set(KEYS.dedupe(job_id), dedupe_record(stream, entry_id), ex=500)
    elif record:
        r.set(KEYS.dedupe(job_id), record, ex=500)
    return entry_id


def test_sweep_moves_unread_and_parked_entries_and_leaves_held_ones(redis_server):
    r = redis_server.client()
    dead = KEYS.affinity("dead", 0)
    r.zadd(KEYS.workers, {"dead": 1})                    # registered, no heartbeat: dead
    r.xgroup_create(dead, GROUP, id="0", mkstream=True)
    running = add(r, dead, "running")
    parked = add(r, dead, "parked")
    r.xreadgroup(GROUP, "dead", {dead: ">"}, count=2)    # both read by the dead worker
    r.xclaim(dead, GROUP, PARKING_CONSUMER, 0, [parked], idle=PARKED_IDLE_MS, justid=True)
    add(r, dead, "unread")
    add(r, dead, "urgent", priority=-3)
    add(r, dead, "taken", record="elsewhere 1-1")        # its id is bound to another entry
    aff = sweeper(redis_server)

    assert aff.sweep() == 4
    assert [e[0].decode() for e in r.xrange(dead)] == [running]   # only the held one stays
    assert aff.foreign == [dead]
    assert record_lane(r, "unread") == record_lane(r, "parked") == KEYS.lane("default")
    assert record_lane(r, "urgent") == KEYS.lane("urgent")
    assert r.get(KEYS.dedupe("taken")) == b"elsewhere 1-1"        # never rebound
    assert 0 < r.ttl(KEYS.dedupe("unread")) <= 500                # KEEPTTL
    assert r.xpending(dead, GROUP)["pending"] == 1                # the parked one was acked
    read = aff.pending.read_new(10)                                  # readable where they went
    assert sorted((e.lane, e.payload is not None) for e in read) == [
        ("default", True)] * 3 + [("urgent", True)]

    got = aff.reclaim(5, min_idle_ms=0)                    # the dead worker's running job
    assert [(e.lane, e.lane_key, e.entry_id, e.deliveries) for e in got] == [
        ("affinity", dead, running, 2)]
    aff.pending.ack([(dead, running)])
    aff.sweep()
    assert not r.exists(dead) and aff.foreign == []        # emptied: deleted


def test_a_live_workers_stream_is_left_alone(redis_server, start_worker):
    start_worker(FakeEngine(max_num_seqs=1, step_delay=0.2), worker_id="busy")
    r = redis_server.client()
    with Client(redis_server.url) as c:
        jobs = c.submit_many([{"prompt": f"p{i}", "routing_key": "k"} for i in range(3)],
                             max_tokens=2)
        aff = sweeper(redis_server)
        time.sleep(0.3)
        assert aff.sweep() == 0 and aff.foreign == []
        assert all(record_lane(r, j.id) == KEYS.affinity("busy", 0) for j in jobs)
        ended_once(r, [j.id for j in jobs])
    assert all(check_stream(r, KEYS, j.id).kind == "done:length" for j in jobs)


def test_a_key_of_the_wrong_type_is_skipped_not_fatal(redis_server):
    r = redis_server.client()
    r.zadd(KEYS.workers, {"odd": 1, "dead": 1})
    r.set(KEYS.heartbeat("odd"), "not a hash")           # HGET fails: not taken for gone
    r.set(KEYS.affinity("dead", 0), "not a stream")      # the move script fails: skipped
    aff = sweeper(redis_server)
    assert aff.sweep() == 0 and aff.foreign == []
