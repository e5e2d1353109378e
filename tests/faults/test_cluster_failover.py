"""A master of a 3-master, 3-replica Redis Cluster killed while a worker streams jobs of a 3-shard
queue: the replica takes over, the worker pauses intake, re-reads the slot map, retries what it
owed and carries on by itself; every job ends, no token is delivered twice."""

from __future__ import annotations

import re

import pytest

from producer_sdk.protocol import key_slot
from producer_sdk.topology import refresh
from tests.fault_harness import FaultEnv, wait_for
from worker.fake_engine import fake_completion
from worker.redis_server import RedisCluster

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster():
    c = RedisCluster(masters=3, replicas=1).start(timeout=60)
    yield c
    c.stop()


def duplicates(problems: list[str]) -> list[str]:
    """Problems that mean a token was delivered twice (a seq at or below one already seen).
    A gap (a seq past the expected one) is what asynchronous replication may lose at a
    failover: events the dead master acknowledged before its replica had them."""
    out = []
    for p in problems:
        m = re.match(r"token seq (\d+), expected (\d+)", p)
        if m is None or int(m.group(1)) < int(m.group(2)):
            out.append(p)
    return out


def test_master_killed_mid_stream_worker_carries_on(cluster, tmp_path, request):
    env = FaultEnv(tmp_path, namespace="fo", shards=3, cluster=cluster)
    request.addfinalizer(env.close)
    env.worker("w1", delay=0.02)
    texts = [f"failover prompt {i}" for i in range(24)]
    jobs = env.submit(texts, max_tokens=150, temperature=0.0, ignore_eos=True)
    wait_for(lambda: env.tokens_streamed(jobs) >= 24 * 10, 60, what="tokens flowing")
    victim = cluster.master_of_slot(key_slot(env.keys.lane("default", 1)))
    cluster.kill(victim)
    slot = key_slot(env.keys.lane("default", 1))
    wait_for(lambda: cluster.master_of_slot(slot) != victim, 30, interval=0.1,
             what="the replica took over")   # the test's own reads wait for that; the
    cluster.wait_ok(30)                      # worker finds out by itself
    refresh(env.r)
    reports = env.wait_ended(jobs, timeout=120)
    for j, text in zip(jobs, texts):
        rep = reports[j]
        assert rep.kind == "done:length", (j, rep.kind)
        assert not duplicates(rep.problems), (j, rep.problems)
        if not rep.problems:
            assert rep.text == fake_completion(text, 150), j
    print(f"{sum(bool(r.problems) for r in reports.values())} of {len(jobs)} streams lost "
          f"events at the failover")
    log = env.workers[0].log()
    assert "pausing intake" in log or "redis connection lost" in log, log[-3000:]
    wait_for(lambda: not env.held_by("w1"), 30, what="every entry acknowledged")
