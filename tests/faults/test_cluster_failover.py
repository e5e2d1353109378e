"""Failover: what Redis's asynchronous replication loses, and the worker carrying on by itself.

A master of a 3-master, 3-replica Redis Cluster killed while a worker streams jobs of a 3-shard
queue: the replica takes over, the worker pauses intake, re-reads the slot map, retries what it
owed and carries on by itself; every job ends exactly once (no token twice, none missing).

A replica promoted after its master died may lack the master's last writes (the master
acknowledged them before sending them on). Every write of the worker checks the job's stream
(its length) and a job whose stream lost events resumes from what survived
(protocol/scripts/results.py, _APPEND). On loopback the replicas are rarely behind, so that loss is also made deterministic
here: the last events of running jobs are deleted while the worker is stopped and its
connections are cut, as a failover would leave them."""

from __future__ import annotations

import signal

import pytest

from tokenrelay.protocol.keys import key_slot
from tokenrelay.protocol.topology import refresh
from tests.fault_harness import FaultEnv, enqueue, ids_on_shard, wait_for
from tokenrelay.worker.fake_engine import fake_completion
from devtools.redis_server import RedisCluster

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster():
    c = RedisCluster(masters=3, replicas=1).start(timeout=60)
    yield c
    c.stop()


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
        assert not rep.problems, (j, rep.problems)
        assert rep.text == fake_completion(text, 150), j
    log = env.workers[0].log()
    print(f"{log.count('its result stream lost events')} jobs resumed after lost events")
    assert "pausing intake" in log or "redis connection lost" in log, log[-3000:]
    wait_for(lambda: not env.held_by("w1"), 30, what="every entry acknowledged")


def test_events_a_failover_lost_are_rewritten_not_skipped(cluster, tmp_path, request):
    """The state a failover to a lagging replica leaves, made on purpose: with the worker
    stopped, the last two events of every running job's stream are deleted (as if the master
    had acknowledged them and died before sending them on), the replica has that state, and
    the master is killed. When the worker runs again its writes fail, it finds the new master,
    sees the streams shorter than it wrote them and resumes each job from what survived: every
    stream is exactly once, contiguous, the full completion."""
    env = FaultEnv(tmp_path, namespace="lost", shards=3, cluster=cluster)
    request.addfinalizer(env.close)
    shard = next(s for s in range(3)
                 if cluster.replicas_of(cluster.master_of_slot(key_slot(env.keys.lane("default", s)))))
    slot = key_slot(env.keys.lane("default", shard))
    victim = cluster.master_of_slot(slot)
    w = env.worker("w1", delay=0.03)
    texts = [f"lost writes prompt {i}" for i in range(6)]
    ids = ids_on_shard(env.keys, shard, "lost", len(texts))
    for job_id, text in zip(ids, texts):
        enqueue(env.r, env.keys, {"job_id": job_id, "prompt": text, "params": {
            "max_tokens": 120, "temperature": 0.0, "ignore_eos": True}})
    wait_for(lambda: all(len(r.token_ids) >= 10 for r in env.streams(ids).values()), 60,
             what="every job streaming")
    w.signal(signal.SIGSTOP)
    try:
        for j in ids:
            key = env.keys.results(j)
            tail = env.r.xrevrange(key, count=2)
            assert tail and b"done" not in tail[0][1][b"data"]
            env.r.xdel(key, *[eid for eid, _ in tail])
        replica = cluster.client(cluster.replicas_of(victim)[0])
        replica.execute_command("READONLY")
        want = {j: env.r.xlen(env.keys.results(j)) for j in ids}
        wait_for(lambda: all(replica.xlen(env.keys.results(j)) == n for j, n in want.items()),
                 10, what="the replica has the shortened streams")
        cluster.kill(victim)
        wait_for(lambda: cluster.master_of_slot(slot) != victim, 30, interval=0.1,
                 what="the replica took over")
    finally:
        w.signal(signal.SIGCONT)
    refresh(env.r)
    reports = env.wait_ended(ids, timeout=120)
    for j, text in zip(ids, texts):
        rep = reports[j]
        assert not rep.problems, (j, rep.problems)
        assert rep.kind == "done:length" and rep.text == fake_completion(text, 120), j
    assert w.log().count("its result stream lost events") == len(ids), w.log()[-3000:]
    wait_for(lambda: not env.held_by("w1"), 30, what="every entry acknowledged")
