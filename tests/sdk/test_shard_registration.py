"""The shard count is never guessed (issue #25): a producer registers its count, or learns the
registered one, before its first enqueue, so jobs sent before any worker started land where the
workers will read. On a real redis-server with in-process workers (FakeEngine); the refusal of
a worker whose ``--shards`` differs runs ``tokenrelay worker``."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from tokenrelay.producer_sdk import AsyncClient, Client, ShardCountMismatch
from tokenrelay.protocol.keys import Keys
from tokenrelay.protocol.shards import SHARDS_FIELD
from tests.fixtures_redis import REPO_ROOT

pytestmark = pytest.mark.timeout(120)

NS, Q = "reg", "q"


def test_jobs_sent_before_any_worker_all_finish_on_the_count_producers_registered(
        redis_server, start_worker):
    r = redis_server.client()
    with Client(redis_server.url, namespace=NS, queue=Q, shards=3) as first:
        early = first.submit_many([f"early {i}" for i in range(24)], max_tokens=3)
        assert r.hget(Keys(NS, Q).config, SHARDS_FIELD) == b"3"

        async def later() -> list[str]:     # a producer without shards= learns the 3
            async with AsyncClient(redis_server.url, namespace=NS, queue=Q) as c:
                jobs = await c.submit_many([f"late {i}" for i in range(6)], max_tokens=3)
                return [j.id for j in jobs]
        late = asyncio.run(later())
        keys = Keys(NS, Q, 3)
        assert {keys.shard_of(j.id) for j in early} == {0, 1, 2}
        assert sum(r.xlen(lane) for lane in keys.lanes()) == 30
        start_worker(namespace=NS, queue=Q)             # no --shards: uses the registered 3
        for job in early:
            assert job.result(timeout=60).finish_reason == "length"
        assert {s.state for s in first.statuses(late)} <= {"queued", "running", "done"}
        for job_id in late:
            assert first.get(job_id).result(timeout=60).finish_reason == "length"
    r.close()


def test_a_producer_with_another_count_than_the_registered_one_is_refused(redis_server):
    with Client(redis_server.url, namespace=NS, queue=Q) as first:
        first.submit("x", max_tokens=1)                 # nothing registered: it registers 1
    r = redis_server.client()
    assert r.hget(Keys(NS, Q).config, SHARDS_FIELD) == b"1"
    with Client(redis_server.url, namespace=NS, queue=Q, shards=3) as wrong:
        with pytest.raises(ShardCountMismatch, match="registered with 1 shards.*3 were asked"):
            wrong.submit("y", max_tokens=1)
    assert sum(r.xlen(lane) for lane in Keys(NS, Q, 3).lanes()) == 0
    r.close()


def test_a_worker_started_after_producers_registered_another_count_exits_78(redis_server):
    with Client(redis_server.url, namespace=NS, queue=Q, shards=2) as producer:
        producer.submit("x", max_tokens=1)
    done = subprocess.run(
        [sys.executable, "-m", "tokenrelay.worker", "--model", "fake:", "--device", "cpu",
         "--worker-id", "w3", "--shards", "3", "--redis-url", redis_server.url,
         "--namespace", NS, "--queue", Q],
        cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=90)
    assert done.returncode == 78, done.stderr[-2000:]
    assert "registered with 2 shards" in done.stderr and "3 were asked" in done.stderr
