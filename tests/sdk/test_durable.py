"""Durable submit: the enqueue's writes are followed, on the same connection, by ``WAIT`` for
replicas. A master with a ``--replicaof`` replica acknowledges; asking more replicas than
acknowledge (or a server without any) raises NotDurable naming the jobs, which stay enqueued.
(The same on a Redis Cluster without replicas: tests/sdk/test_sharded.py.)"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from tokenrelay.producer_sdk import AsyncClient, Client, NotDurable
from tokenrelay.producer_sdk.batch.runner import BatchRunner
from tokenrelay.protocol.keys import Keys
from tests.fixtures_redis import RedisServer, start_redis_server
from tests.sdk_helpers import FakeWorker, env_with_repo

pytestmark = pytest.mark.timeout(90)
KEYS = Keys()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    """A master and one replica of it (``--replicaof``), linked."""
    master = start_redis_server(tmp_path_factory.mktemp("master"), "--repl-diskless-sync-delay",
                                "0")
    replica = None
    try:
        replica = start_redis_server(tmp_path_factory.mktemp("replica"), "--replicaof",
                                     "127.0.0.1", str(master.port))
        deadline = time.monotonic() + 20
        while master.client().info("replication").get("connected_slaves") != 1 or \
                replica.client().info("replication").get("master_link_status") != "up":
            assert time.monotonic() < deadline, "the replica did not link"
            time.sleep(0.05)
        yield master, replica
    finally:
        for srv in (replica, master):
            if srv is not None:
                srv.kill()


@pytest.fixture
def master(pair) -> RedisServer:
    pair[0].client().flushall()
    return pair[0]


def offset(srv: RedisServer) -> int:
    return int(srv.client().info("replication")["master_repl_offset"])


def test_a_durable_submit_is_acknowledged_by_the_replica(master, pair):
    replica = pair[1].client()
    with Client(master.url, durable=True) as c:
        job = c.submit("x", job_id="d1", max_tokens=1)
        assert replica.get(KEYS.dedupe("d1"))            # on the replica when submit returned
        jobs = c.submit_many([f"p{i}" for i in range(20)], max_tokens=1)
        assert all(replica.get(KEYS.dedupe(j.id)) for j in jobs)
        before = offset(master)
        again = c.submit("x", job_id="d1", max_tokens=1)    # known: written again unchanged,
        assert again.reattached and offset(master) > before  # so WAIT proves the replica has it
        assert c.redis.ttl(KEYS.dedupe("d1")) > 0
        plain = c.submit("y", max_tokens=1, durable=False)  # the client default, overridden
        assert plain.id

    async def main() -> str:
        async with AsyncClient(master.url) as ac:
            one = await ac.submit("async", max_tokens=1, durable=True)
            await ac.submit_many(["a", "b"], durable=True, max_tokens=1)
            return one.id
    assert replica.get(KEYS.dedupe(asyncio.run(main())))
    replica.close()


def test_a_durable_routed_submit_is_acknowledged_with_its_affinity_stream_entry(master, pair):
    """Jobs routed by a routing key ride the same rounds: the WAIT behind them covers their
    affinity stream entries and dedupe records."""
    replica = pair[1].client()
    r = master.client()
    r.hset(KEYS.heartbeat("wa"), mapping={"queue": "default", "engine_loaded": 1, "draining": 0,
                                          "affinity": 1, "held": 0, "affinity_queued": 0})
    r.zadd(KEYS.workers, {"wa": 1})
    r.xgroup_create(KEYS.affinity("wa", 0), "workers", id="0", mkstream=True)
    with Client(master.url, durable=True) as c:
        jobs = c.submit_many([{"prompt": "p", "routing_key": "conv"} for _ in range(5)])
    assert replica.xlen(KEYS.affinity("wa", 0)) == 5
    assert all(replica.get(KEYS.dedupe(j.id)).startswith(KEYS.affinity("wa", 0).encode())
               for j in jobs)
    replica.close()
    r.close()


def test_more_replicas_than_acknowledge_is_not_durable_and_the_jobs_stay(master):
    with Client(master.url, durable_replicas=2, durable_timeout_ms=100) as c:
        t0 = time.monotonic()
        with pytest.raises(NotDurable) as err:
            c.submit_many([{"prompt": "x", "job_id": f"nd{i}"} for i in range(3)],
                          durable=True, max_tokens=1)
        assert time.monotonic() - t0 < 2
        e = err.value
        assert (e.acked, e.asked, sorted(e.job_ids)) == (1, 2, ["nd0", "nd1", "nd2"])
        assert [j.id for j in e.jobs] == ["nd0", "nd1", "nd2"]
        assert "1 of 2" in str(e)
        assert c.queue_depth() == 3                        # enqueued all the same
        with pytest.raises(NotDurable):
            c.submit("x", job_id="nd0", durable=True)       # resubmitting dedupes
        assert c.queue_depth() == 3


def test_a_server_without_replicas_is_not_durable(tmp_path: Path):
    srv = start_redis_server(tmp_path / "alone")
    try:
        with Client(srv.url, durable_timeout_ms=100) as c:
            with pytest.raises(NotDurable) as err:
                c.submit("x", job_id="alone", durable=True)
            assert (err.value.acked, err.value.asked, err.value.job_ids) == (0, 1, ["alone"])
            assert c.status("alone").state == "queued"

        async def main() -> NotDurable:
            async with AsyncClient(srv.url, durable=True, durable_timeout_ms=100) as ac:
                try:
                    await ac.submit("y")
                except NotDurable as exc:
                    return exc
            raise AssertionError("no NotDurable")
        assert asyncio.run(main()).acked == 0
    finally:
        srv.kill()


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenrelay.producer_sdk", *args], capture_output=True,
                          text=True, timeout=60, env=env_with_repo())


def test_the_cli_and_the_batch_runner_submit_durably(master, tmp_path: Path):
    url = ["--redis-url", master.url]
    ok = cli("submit", "x", "--durable", "--timeout", "0.2", "--wait-for-worker", *url)
    assert ok.returncode == 5, ok.stderr                  # durable, then no worker answered
    short = cli("submit", "x", "--wait-for-worker", "--durable", "--durable-replicas", "2",
                "--durable-timeout-ms", "100", *url)
    assert short.returncode == 7 and "1 of 2" in short.stderr, short.stderr
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": f"c{i}", "method": "POST",
                                       "url": "/v1/completions",
                                       "body": {"model": "m", "prompt": "p",
                                                "max_tokens": 2}}) + "\n"
                           for i in range(10)))
    r = redis.Redis.from_url(master.url)
    r.delete(*KEYS.lanes())                              # the CLI's jobs: no worker takes them
    with Client(master.url) as c, FakeWorker(master.url):
        summary = BatchRunner(c, inp, out, batch_id="dur", progress=False, durable=True).run()
    assert summary.succeeded == 10
    r.close()


@pytest.mark.timeout(180)
def test_durable_jobs_survive_a_master_killed_right_after_the_submit():
    """3 masters with a replica each: a durable submit returns once every master's replica
    acknowledged; SIGKILL the master of one shard at once, its replica is promoted, every job
    is still there (the only replica acknowledged, so it is the one promoted), and the next
    submit goes through once the cluster failed over, without the caller retrying."""
    from tokenrelay.protocol.keys import key_slot
    from devtools.redis_server import RedisCluster
    keys = Keys("tokenrelay", "dq", 3)
    with RedisCluster(masters=3, replicas=1) as cluster, \
            Client(cluster.url, queue="dq", shards=3, durable=True) as c:
        jobs = c.submit_many([{"prompt": "x", "job_id": f"h{i}"} for i in range(30)],
                             max_tokens=1)
        assert {j.shard for j in jobs} == {0, 1, 2}
        cluster.kill(cluster.master_of_slot(key_slot(keys.tag(1))))
        # the producer carries on by itself: its next submit waits out the failover (its
        # promoted replica has no replica left, so this one is not durable)
        more = c.submit_many([{"prompt": "y", "job_id": f"w{i}"} for i in range(12)],
                             durable=False, max_tokens=1)
        assert {j.shard for j in more} == {0, 1, 2}
        found = c.statuses([j.id for j in jobs + more])
        assert [s.state for s in found] == ["queued"] * 42
        assert c.queue_depth() == 42
