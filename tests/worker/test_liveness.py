"""worker/liveness.py against real redis-server processes: the worker id lease (scripts
ID_CLAIM/ID_RELEASE; Redis 7 and 6.2), the heartbeat it writes (protocol/heartbeat.py), and
what a tick reports (a lost worker id, an admin's drain flag, entries reclaimed from us) with
what the loop does about each."""

from __future__ import annotations

import socket
import subprocess

import pytest

from tokenrelay.protocol.heartbeat import INSTANCE_FIELD, Heartbeat
from tokenrelay.protocol.keys import GROUP
from tokenrelay.protocol.wire import now_ms
from tests.fault_harness import submit
from tests.worker.hand_driven import KEYS, hand_worker, iterate_until  # noqa: F401
from tests.worker.redis_layer import keys, r  # noqa: F401
from tokenrelay.worker.liveness import Cadence, Tick, WorkerIdInUse, WorkerIdLease

pytestmark = pytest.mark.timeout(60)


def test_worker_id_lease_one_live_process_per_id(r, keys):
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


# ------------------------------------------------------------------------------------------
# what a tick reports, and what the loop does about it
# ------------------------------------------------------------------------------------------

def test_a_beat_writes_the_schema_and_a_tick_reports_nothing_when_all_is_well(hand_worker,
                                                                             redis_server):
    r = redis_server.client()
    w = hand_worker(served_model_name="alpha")
    tick = w._crew().liveness.tick(draining=False)
    assert tick == Tick()
    beat = Heartbeat.decode(r.hgetall(KEYS.heartbeat("w1")))
    assert beat.serving("default") and beat.affinity and beat.served_model_name == "alpha"
    assert beat.instance == w._crew().liveness.id_lease.instance
    assert abs(beat.ts - now_ms()) < 5000 and beat.held == 0 and beat.redis_error == ""


def test_a_lost_worker_id_stops_the_worker_at_once_touching_nothing(hand_worker, redis_server):
    r = redis_server.client()
    w = hand_worker()
    submit(r, KEYS, {"job_id": "j", "prompt": "p", "params": {"max_tokens": 50}})
    iterate_until(w, lambda: "j" in w.jobs)
    r.hset(KEYS.heartbeat("w1"), INSTANCE_FIELD, "elsewhere:1:t")     # a successor took it
    w._crew().liveness.cadence = Cadence()                             # a beat is due now
    tick = w._crew().liveness.tick(draining=False)
    assert tick.lost_worker_id and not tick.drain_requested and tick.lost_entries == []
    w._on_tick(tick)
    assert w.exit_code == 3 and w.stopping and not w.jobs
    assert not w.engine.has_unfinished_requests()


def test_an_admin_drain_flag_starts_a_graceful_drain(hand_worker, redis_server):
    r = redis_server.client()
    w = hand_worker()
    r.set(KEYS.drain("w1"), "1")
    w._crew().liveness.cadence = Cadence()
    tick = w._crew().liveness.tick(draining=False)
    assert tick.drain_requested and not tick.lost_worker_id
    w._on_tick(tick)
    assert w.stopping and not w._force.is_set() and w.exit_code == 0


def test_an_entry_reclaimed_from_us_is_reported_and_its_job_dropped(hand_worker, redis_server):
    r = redis_server.client()
    w = hand_worker()
    entry_id = submit(r, KEYS, {"job_id": "j", "prompt": "p", "params": {"max_tokens": 50}})
    iterate_until(w, lambda: "j" in w.jobs)
    r.xclaim(KEYS.lane("default"), GROUP, "w2", 0, [entry_id], justid=True)   # w2 reclaimed it
    w._crew().liveness.cadence = Cadence()
    tick = w._crew().liveness.tick(draining=False)
    assert tick.lost_entries == [(KEYS.lane("default"), entry_id)]
    w._on_tick(tick)
    assert "j" not in w.jobs and not w.engine.has_unfinished_requests() and not w.stopping
