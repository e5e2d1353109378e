"""The worker id lease (worker/liveness.py, scripts ID_CLAIM/ID_RELEASE) against real
redis-server processes, Redis 7 and 6.2: one live process per worker id."""

from __future__ import annotations

import socket
import subprocess

import pytest

from tests.worker.redis_layer import keys, r  # noqa: F401
from worker.liveness import WorkerIdInUse, WorkerIdLease

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
