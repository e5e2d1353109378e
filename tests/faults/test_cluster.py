"""The worker against a 3-master Redis Cluster (one cluster for the module, a namespace per test):
a 3-shard queue whose shards live on the three masters, streaming, cancel, SIGKILL mid-stream and
resume on another worker, priorities across shards, dead letters and the admin and health
commands, the idle worker's blocking reads, and what one engine step costs on the wire (one
round trip per node, not per job)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from typing import Any

import msgpack
import pytest

from tokenrelay.protocol.keys import Keys, PAYLOAD_FIELD, dedupe_record, key_slot
from tokenrelay.protocol.scripts import WRITE_STEP
from tokenrelay.protocol.scripts import pipeline as script_pipeline
from tokenrelay.protocol.shards import SHARDS_FIELD
from tests.fault_harness import FaultEnv, check_stream, enqueue, ids_on_shard, wait_for
from tests.fixtures_redis import REPO_ROOT
from tokenrelay.worker import admin
from tokenrelay.worker.fake_engine import FakeEngine, fake_completion
from devtools.redis_server import RedisCluster

pytestmark = pytest.mark.timeout(180)

_namespaces = itertools.count()


@pytest.fixture(scope="module")
def cluster(redis_cluster):
    return redis_cluster


@pytest.fixture
def env(cluster, tmp_path, request):
    e = FaultEnv(tmp_path, namespace=f"cl{next(_namespaces)}", shards=3, cluster=cluster)
    request.addfinalizer(e.close)
    return e


def prompts(n: int, tag: str = "p") -> list[str]:
    return [f"{tag} number {i} says hello" for i in range(n)]


def first_entry_ms(env: FaultEnv, job_id: str) -> int:
    """When the job's first result event (its started) was written."""
    (eid, _), = env.r.xrange(env.keys.results(job_id), count=1)
    return int(eid.decode().split("-")[0])


def test_shards_on_three_masters_stream_exactly_once_and_health_answers(env, cluster):
    masters = {cluster.master_of_slot(key_slot(env.keys.lane("default", s))) for s in range(3)}
    assert len(masters) == 3, "the shards' tags should spread over the masters"
    env.worker("w1")
    assert env.r.hget(env.keys.config, SHARDS_FIELD) == b"3"
    texts = prompts(24)
    jobs = env.submit(texts, max_tokens=12, temperature=0.0)
    assert {env.keys.shard_of(j) for j in jobs} == {0, 1, 2}
    reports = env.wait_ended(jobs, timeout=60)
    env.assert_exactly_once(reports)
    for j, text in zip(jobs, texts):
        assert reports[j].kind == "done:length" and reports[j].text == fake_completion(text, 12)
    health = subprocess.run([sys.executable, "-m", "tokenrelay.worker", "health", "--worker-id", "w1",
                             "--redis-url", env.url, "--namespace", env.keys.namespace,
                             "--queue", env.keys.queue], cwd=str(REPO_ROOT),
                            capture_output=True, text=True, timeout=60)
    assert health.returncode == 0 and "alive" in health.stdout, health.stderr


def test_cancel_in_a_cluster(env):
    env.worker("w1", delay=0.01)
    (jid,) = ids_on_shard(env.keys, 1, "long", 1)
    enqueue(env.r, env.keys, {"job_id": jid, "prompt": "p", "params": {"max_tokens": 2000}})
    wait_for(lambda: len(check_stream(env.r, env.keys, jid).token_ids) > 3, 20,
             what="tokens flowing")
    env.r.set(env.keys.cancel(jid), 1, ex=60)
    rep = env.wait_ended([jid], timeout=20)[jid]
    assert rep.kind == "done:cancelled" and not rep.problems
    assert rep.terminal.usage.completion_tokens < 2000


def test_sigkill_mid_stream_resumes_on_another_worker(env):
    workers = {wid: env.worker(wid, wait=False) for wid in ("w1", "w2")}
    for w in workers.values():
        w.wait_for_log("worker ready")
    texts = prompts(24, "kill")
    jobs = env.submit(texts, max_tokens=40, temperature=0.0, ignore_eos=True)
    wait_for(lambda: env.tokens_streamed(jobs) >= 24 * 5, 60, what="tokens flowing")
    victim = max(workers, key=lambda wid: len(env.held_by(wid)))
    survivor = "w2" if victim == "w1" else "w1"
    held = env.held_by(victim)
    workers[victim].kill()
    reports = env.wait_ended(jobs, timeout=90)
    env.assert_exactly_once(reports)
    for j, text in zip(jobs, texts):
        assert reports[j].kind == "done:length" and reports[j].text == fake_completion(text, 40)
    resumed = [rep for rep in reports.values() if len(rep.started) > 1]
    assert held and resumed, "the victim held nothing when killed: the test proved nothing"
    assert all(rep.started[-1].worker_id == survivor and rep.started[-1].resumed_tokens > 0
               for rep in resumed)


def test_urgent_job_behind_a_bulk_backlog_on_a_three_shard_cluster_queue(env):
    env.worker("w1", model="fake:step_delay=0.01,max_num_seqs=2")
    bulk = env.submit(prompts(24, "bulk"), prefix="bulk", priority=5, max_tokens=10)
    wait_for(lambda: sum(check_stream(env.r, env.keys, j).started != [] for j in bulk) >= 2,
             20, what="the first bulk jobs started")
    (urgent,) = env.submit(["now"], prefix="urgent", priority=-1, max_tokens=3)
    reports = env.wait_ended(bulk + [urgent], timeout=60)
    env.assert_exactly_once(reports)
    assert all(len(rep.started) == 1 for rep in reports.values())
    before = [j for j in bulk if first_entry_ms(env, j) < first_entry_ms(env, urgent)]
    assert len(before) <= 4, f"{len(before)} bulk jobs started before the urgent one"


def test_dead_letters_on_their_shards_node_and_admin_over_the_cluster(env, capsys):
    env.worker("w1")
    bad = [ids_on_shard(env.keys, s, "bad", 1)[0] for s in range(3)]
    for j in bad:
        s = env.keys.shard_of(j)
        lane = env.keys.lane("default", s)
        eid = env.r.xadd(lane, {PAYLOAD_FIELD: msgpack.packb(
            {"v": 1, "job_id": j, "prompt": "x", "bogus": 1})}).decode()
        env.r.set(env.keys.dedupe(j, s), dedupe_record(lane, eid))
    wait_for(lambda: all(env.r.xlen(env.keys.dead(env.keys.shard_of(j))) for j in bad), 20,
             what="a dead letter on each shard")
    assert all(check_stream(env.r, env.keys, j).kind == "error:invalid_request" for j in bad)
    argv = ["--redis-url", env.url, "--namespace", env.keys.namespace, "--queue", env.keys.queue]
    assert admin.main([*argv, "dead", "list"]) == 0
    listed = capsys.readouterr().out
    assert all(j in listed for j in bad)
    assert admin.main([*argv, "workers"]) == 0 and "w1" in capsys.readouterr().out
    assert admin.main([*argv, "dead", "purge", "--all"]) == 0
    assert "purged 3" in capsys.readouterr().out


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_worker_sleeps_and_wakes_on_any_shard_within_milliseconds(env):
    """One blocking read per shard (each on its master), waited on with select(): an idle worker
    burns no CPU, and a job enqueued on any shard starts at once, not after a poll interval."""
    w = env.worker("w1", **{"block-ms": 2000, "log-level": "info"})
    time.sleep(0.5)
    cpu0 = _cpu_s(w.pid)
    time.sleep(3.0)
    idle_cpu = _cpu_s(w.pid) - cpu0
    latencies = []
    for s in (0, 1, 2, 1, 0, 2):
        jid = ids_on_shard(env.keys, s, f"wake{len(latencies)}", 1)[0]
        time.sleep(0.3)                      # the worker is back in its blocking reads
        t0 = time.monotonic()
        enqueue(env.r, env.keys, {"job_id": jid, "prompt": "x", "params": {"max_tokens": 1}})
        wait_for(lambda: env.r.exists(env.keys.results(jid)), 5, interval=0.001,
                 what=f"job on shard {s} started")
        latencies.append(time.monotonic() - t0)
    print(f"idle CPU {idle_cpu:.3f} s in 3 s; enqueue-to-start ms: "
          f"{[round(x * 1000, 1) for x in latencies]}")
    assert idle_cpu < 0.3, f"an idle worker used {idle_cpu:.2f} s of CPU in 3 s"
    assert max(latencies) < 0.5, latencies      # block-ms is 2 s: no shard waited for a poll


class _Spy:
    """Wraps send_packed: per call, the WRITE_STEP calls it carried (node, jobs written)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.calls: list[list[tuple[str, int]]] = []
        self._sha = WRITE_STEP.sha.encode()

    def __call__(self, client: Any, items: Any) -> Any:
        steps = []
        for key, data, _ in items:
            if self._sha in data:
                numkeys = int(data.split(b"\r\n")[6])     # EVALSHA sha numkeys: 3 per job
                steps.append((client.get_node_from_key(key).name, numkeys // 3))
        if steps:
            self.calls.append(steps)
        return self.real(client, items)


def _evalsha_calls(cluster: RedisCluster) -> int:
    total = 0
    for i in range(len(cluster.nodes)):
        c = cluster.client(i)
        total += int(c.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))
        c.close()
    return total


def test_one_step_costs_one_round_trip_per_node_not_per_job(cluster, monkeypatch):
    """An in-process worker on the FakeEngine with 30 jobs running on three shards: each flush
    sends one WRITE_STEP per shard (one script call per node here), whatever the number of
    jobs, all in one send_packed call (one write and one read per node)."""
    from tokenrelay.worker.config import WorkerSettings
    from tokenrelay.worker.service import Worker
    keys = Keys(f"cl{next(_namespaces)}", "q", 3)
    spy = _Spy(script_pipeline.send_packed)
    monkeypatch.setattr(script_pipeline, "send_packed", spy)
    settings = WorkerSettings(redis_url=cluster.url, worker_id="w1", model="fake:",
                              namespace=keys.namespace, queue=keys.queue, shards=3,
                              block_ms=50, heartbeat_ms=200, result_ttl=120.0)
    w = Worker(settings, engine=FakeEngine(max_num_seqs=64, step_delay=0.005))
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    try:
        assert w.ready.wait(20)
        r = w.client
        ids = [f"rt-{i}" for i in range(30)]
        calls_before = _evalsha_calls(cluster)
        for j in ids:
            enqueue(r, keys, {"job_id": j, "prompt": j, "params": {"max_tokens": 30}})
        wait_for(lambda: all(check_stream(r, keys, j).ended for j in ids), 60,
                 what="every job ended")
        evalsha = _evalsha_calls(cluster) - calls_before
    finally:
        w.stop(force=True)
        t.join(15)
    job_writes = sum(n for call in spy.calls for _, n in call)
    for call in spy.calls:
        nodes = [node for node, _ in call]
        assert len(nodes) == len(set(nodes)), f"several WRITE_STEP calls to one node: {call}"
    widest = max(spy.calls, key=lambda call: sum(n for _, n in call))
    print(f"{len(spy.calls)} flushes, {job_writes} job writes, widest flush "
          f"{sum(n for _, n in widest)} jobs in {len(widest)} script calls; "
          f"EVALSHA calls on the cluster {evalsha}")
    assert sum(n for _, n in widest) >= 20 and len(widest) == 3
    assert evalsha < job_writes / 2, "script calls grew with the jobs, not with the nodes"


def test_worker_health_and_admin_run_under_the_documented_acl_rules(cluster, tmp_path, capsys):
    """The worker and admin rules of docs/operations.md plus the cluster's additions, set on
    every node: a worker serves jobs, health and admin answer, and no node logs a denial."""
    from tests.faults.test_security import CLUSTER_COMMANDS, IGNORED_DENIALS, acl_rule
    ns = f"acl{next(_namespaces)}"
    extra = " ".join(f"+{c}" for c in CLUSTER_COMMANDS)
    for i in range(len(cluster.nodes)):
        node = cluster.client(i)
        node.execute_command("ACL", "LOG", "RESET")
        for role in ("worker", "admin"):
            node.execute_command("ACL", "SETUSER", f"{ns}-{role}",
                                 *f"{acl_rule(role, ns, 'pw')} {extra}".split())
        node.close()
    url = {role: cluster.url.replace("redis://", f"redis://{ns}-{role}:pw@")
           for role in ("worker", "admin")}
    env = FaultEnv(tmp_path, namespace=ns, shards=3, cluster=cluster)
    try:
        env.url = url["worker"]
        env.worker("w1")
        jobs = env.submit(prompts(6, "acl"), max_tokens=4)
        env.assert_exactly_once(env.wait_ended(jobs, timeout=30))
        health = subprocess.run([sys.executable, "-m", "tokenrelay.worker", "health", "--worker-id", "w1",
                                 "--redis-url", url["worker"], "--namespace", ns,
                                 "--queue", env.keys.queue], cwd=str(REPO_ROOT),
                                capture_output=True, text=True, timeout=60)
        assert health.returncode == 0, health.stderr
        argv = ["--redis-url", url["admin"], "--namespace", ns, "--queue", env.keys.queue]
        for cmd in (["pending"], ["workers"], ["dead", "list"]):
            assert admin.main([*argv, *cmd]) == 0, capsys.readouterr().err
    finally:
        env.close()
    denied = []
    for i in range(len(cluster.nodes)):
        node = cluster.client(i)
        for e in node.execute_command("ACL", "LOG"):
            entry = dict(zip(e[::2], e[1::2])) if isinstance(e, list) else e
            if entry.get("username", "").startswith(ns) and entry.get("object") \
                    not in IGNORED_DENIALS:
                denied.append((i, entry.get("username"), entry.get("object")))
        node.close()
    assert not denied, denied
