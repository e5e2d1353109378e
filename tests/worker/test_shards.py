"""A sharded queue (``--shards 3``) on one redis-server: the worker reads every shard, keeps
priorities across them, never starts more than it has room for, and keeps each job's keys, dead
letters and replays on the shard its entry came from. In-process workers on the FakeEngine; the
SIGKILL scenario and the refusals run ``tokenrelay worker`` subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import msgpack
import pytest

from tokenrelay.protocol.keys import GROUP, Keys, PAYLOAD_FIELD, dedupe_record
from tokenrelay.protocol.wire import DeadLetter
from tokenrelay.protocol.shards import SHARDS_FIELD
from tests.fault_harness import (REDIS_7, REDIS_62, FaultEnv, check_stream, enqueue, ids_on_shard, pending_summary,
                                 read_events, wait_all_ended, wait_for, wait_for_terminal)
from tests.fixtures_redis import REPO_ROOT, RedisServer
from tokenrelay.worker import admin
from tokenrelay.worker.pending import PendingList
from tokenrelay.worker.fake_engine import FakeEngine, fake_completion

pytestmark = pytest.mark.timeout(120)

KEYS = Keys("sh", "q", 3)


@pytest.fixture
def r(redis_server):
    client = redis_server.client()
    client.url = redis_server.url
    yield client
    client.close()


def job(job_id: str, prompt: str = "hello", max_tokens: int = 5, **kw: Any) -> dict:
    return {"job_id": job_id, "prompt": prompt,
            "params": {"max_tokens": max_tokens, "temperature": 0}, **kw}


@pytest.fixture(params=["redis7", "redis62"])
def any_redis(request, tmp_path):
    """A server of each supported version (6.2 where its binary is installed)."""
    binary = REDIS_7 if request.param == "redis7" else REDIS_62
    if not os.path.exists(binary):
        pytest.skip("no Redis 6.2 binary here")
    server = RedisServer(dir=tmp_path / "redis", binary=binary).start()
    request.addfinalizer(server.kill)
    client = server.client()
    yield client
    client.close()


def sharded_worker(start_worker, engine: Any = None, **overrides: Any):
    return start_worker(engine=engine, namespace=KEYS.namespace, queue=KEYS.queue, shards=3,
                        **overrides)


def started_ms(r, job_id: str) -> int:
    """When the job's started event was written (its entry id's time)."""
    (eid, _), = r.xrange(KEYS.results(job_id), count=1)
    return int(eid.decode().split("-")[0])


def test_jobs_on_every_shard_finish_exactly_once_with_their_keys_on_their_shard(start_worker, r):
    sharded_worker(start_worker)
    assert r.hget(KEYS.config, SHARDS_FIELD) == b"3"      # the first worker registered it
    ids = [f"j-{i}" for i in range(30)]
    assert {KEYS.shard_of(j) for j in ids} == {0, 1, 2}
    for j in ids:
        enqueue(r, KEYS, job(j, f"prompt {j}", 6))
    reports = wait_all_ended(r, KEYS, ids, 30)
    for j, rep in reports.items():
        assert not rep.problems and rep.kind == "done:length", (j, rep.problems)
        assert rep.text == fake_completion(f"prompt {j}", 6)
        s = KEYS.shard_of(j)
        assert r.get(KEYS.owner(j, s)).startswith(b"w1:")     # fenced in the entry's shard
    wait_for(lambda: not pending_summary(r, KEYS), what="every entry acked")
    assert all(r.xlen(lane) == 0 for lane in KEYS.lanes())


def test_urgent_job_behind_a_bulk_backlog_starts_first(start_worker, r):
    """Two slots, 24 bulk jobs spread over the shards, then one urgent job: it starts as soon
    as a slot frees, ahead of every bulk job still queued on any shard; no job is started twice
    (what a shard read brought past capacity was handed back uncounted)."""
    sharded_worker(start_worker, FakeEngine(max_num_seqs=2, step_delay=0.01))
    bulk = [f"bulk-{i}" for i in range(24)]
    for j in bulk:
        enqueue(r, KEYS, job(j, j, 10, priority=5))
    wait_for(lambda: sum(bool(read_events(r, KEYS, j)) for j in bulk) >= 2,
             what="the first bulk jobs started")
    urgent = "urgent"
    enqueue(r, KEYS, job(urgent, "now", 3, priority=-1))
    reports = wait_all_ended(r, KEYS, bulk + [urgent], 60)
    assert all(not rep.problems and len(rep.started) == 1 for rep in reports.values())
    before = [j for j in bulk if started_ms(r, j) < started_ms(r, urgent)]
    assert len(before) <= 4, f"{len(before)} bulk jobs started before the urgent one"
    assert r.xlen(KEYS.dead(0)) + r.xlen(KEYS.dead(1)) + r.xlen(KEYS.dead(2)) == 0


def test_reads_take_every_shard_parked_entries_first_with_their_counts(any_redis):
    r = any_redis
    w1, w2 = PendingList(r, KEYS, "w1"), PendingList(r, KEYS, "w2")
    w1.ensure_groups()
    at = {}
    for name, lane, shard in (("b0", "bulk", 0), ("u1", "urgent", 1), ("d1", "default", 1),
                              ("d2", "default", 2)):
        at[name] = r.xadd(KEYS.lane(lane, shard), {PAYLOAD_FIELD: name.encode()}).decode()
    got = sorted(w1.read_new(10), key=w1.lanes.urgency)
    assert [(e.payload, e.shard, e.source) for e in got] == [
        (b"u1", 1, "new"), (b"d1", 1, "new"), (b"d2", 2, "new"), (b"b0", 0, "new")]
    stats = w1.lane_stats()      # one series per lane name, summed over the shards
    assert {lane: pending for lane, (_, pending) in stats.items()} == {
        "urgent": 1, "default": 2, "bulk": 1, "affinity": 0}   # affinity: its own streams
    assert w1.park([e.key for e in got if e.lane == "default"]) == []
    r.xadd(KEYS.lane("default", 1), {PAYLOAD_FIELD: b"d3"})
    r.xdel(KEYS.lane("default", 2), at["d2"])            # deleted while parked
    again = sorted(w2.read_new(1), key=w2.lanes.urgency)       # one per shard: the parked ones
    assert [(e.entry_id, e.source, e.deliveries) for e in again] == [
        (at["d1"], "parked", 1), (at["d2"], "parked", 1)]
    assert again[0].payload == b"d1" and again[1].fields is None
    assert [e.payload for e in w2.read_new(5)] == [b"d3"]


class CountingEngine(FakeEngine):
    """A FakeEngine that records the most requests it ever held at once."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.most = 0

    def add_request(self, *args: Any, **kw: Any) -> None:
        super().add_request(*args, **kw)
        self.most = max(self.most, self.num_unfinished_requests())


def test_never_admits_more_than_capacity_from_all_shards_together(start_worker, r):
    """Every shard holds a backlog, each shard's read asks for the whole free capacity: what
    they bring together past it goes back to the queue, so the engine never holds more than
    max_num_seqs and every job still runs exactly once."""
    for i in range(36):
        enqueue(r, KEYS, job(f"b-{i}", f"b {i}", 4, priority=[-1, 0, 3][i % 3]))
    eng = CountingEngine(max_num_seqs=3, step_delay=0.005)
    sharded_worker(start_worker, eng)
    ids = [f"b-{i}" for i in range(36)]
    reports = wait_all_ended(r, KEYS, ids, 60)
    assert all(not rep.problems and len(rep.started) == 1 for rep in reports.values())
    assert eng.most <= 3
    # urgent jobs first: the last urgent one started before the last default one
    last = {p: max(started_ms(r, f"b-{i}") for i in range(36) if i % 3 == k)
            for k, p in enumerate(("urgent", "default", "bulk"))}
    assert last["urgent"] <= last["default"] <= last["bulk"]


def test_cancel_on_a_sharded_queue(start_worker, r):
    sharded_worker(start_worker, FakeEngine(step_delay=0.01))
    (jid,) = ids_on_shard(KEYS, 2, "long", 1)
    enqueue(r, KEYS, job(jid, "p", 500))
    wait_for(lambda: len(read_events(r, KEYS, jid)) > 3, what="tokens flowing")
    r.set(KEYS.cancel(jid), 1, ex=60)            # the producer's key: the job id's shard
    events = wait_for_terminal(r, KEYS, jid, 10)[jid]
    assert events[-1].type == "done" and events[-1].finish_reason == "cancelled"
    assert events[-1].usage.completion_tokens < 500


def poison(r, keys: Keys, job_id: str) -> None:
    """A job whose entry was delivered past --max-deliveries (its holders kept dying)."""
    lane, eid = enqueue(r, keys, job(job_id, "poisoned once", 3))
    r.xreadgroup(GROUP, "crashy", {lane: ">"}, count=1)
    r.xclaim(lane, GROUP, "crashy", 0, [eid], idle=60_000, retrycount=5, justid=True)


def test_dead_letters_land_on_their_shard_and_admin_lists_replays_and_purges(start_worker, r,
                                                                             capsys):
    for lane in KEYS.lanes():                     # groups exist before the crashy reader reads
        r.xgroup_create(lane, GROUP, id="0", mkstream=True)
    (sick,) = ids_on_shard(KEYS, 1, "sick", 1)
    poison(r, KEYS, sick)
    bad = [ids_on_shard(KEYS, s, "bad", 1)[0] for s in range(3)]
    for j in bad:   # a payload with a field the protocol does not know: invalid_request
        s = KEYS.shard_of(j)
        eid = r.xadd(KEYS.lane("default", s), {PAYLOAD_FIELD: msgpack.packb(
            {"v": 1, "job_id": j, "prompt": "x", "bogus": 1})}).decode()
        r.set(KEYS.dedupe(j, s), dedupe_record(KEYS.lane("default", s), eid))
    sharded_worker(start_worker, lease_ms=500, max_deliveries=3)
    out = wait_for_terminal(r, KEYS, bad + [sick], 15)
    assert {out[j][-1].code for j in bad} == {"invalid_request"}
    assert out[sick][-1].code == "poison"
    wait_for(lambda: sum(r.xlen(d) for d in KEYS.dead_streams()) == 4, what="four letters")
    on = {s: sorted(DeadLetter.from_fields(f).job_id for _, f in r.xrange(KEYS.dead(s)))
          for s in range(3)}
    assert on == {0: [bad[0]], 1: sorted([bad[1], sick]), 2: [bad[2]]}

    letters = admin.list_dead(r, KEYS)
    assert sorted(d.job_id for _, d in letters) == sorted(bad + [sick])
    argv = ["--redis-url", r.url, "--namespace", KEYS.namespace, "--queue", KEYS.queue]
    assert admin.main([*argv, "--json", "dead", "list"]) == 0
    listed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # after worker logs
    assert sorted(row["job_id"] for row in listed) == sorted(bad + [sick])
    (dead_id,) = [eid for eid, d in letters if d.job_id == sick]
    assert admin.main([*argv, "dead", "replay", dead_id]) == 0   # shard count: registered
    assert f"replayed {sick}" in capsys.readouterr().out
    wait_for(lambda: (check_stream(r, KEYS, sick).kind == "done:length"), 15,
             what="the replayed job ran")
    assert check_stream(r, KEYS, sick).text == fake_completion("poisoned once", 3)
    assert admin.main([*argv, "dead", "purge", "--all"]) == 0
    assert "purged 3" in capsys.readouterr().out
    assert admin.list_dead(r, KEYS) == []


@pytest.mark.timeout(180)
def test_sigkilled_workers_jobs_are_reclaimed_on_every_shard_exactly_once(tmp_path, request):
    env = FaultEnv(tmp_path, shards=3)
    request.addfinalizer(env.close)
    workers = {wid: env.worker(wid, wait=False) for wid in ("w1", "w2")}
    for w in workers.values():
        w.wait_for_log("worker ready")
    jobs = env.submit([f"sharded prompt {i}" for i in range(24)], max_tokens=40,
                      temperature=0.0, ignore_eos=True)
    assert {env.keys.shard_of(j) for j in jobs} == {0, 1, 2}
    wait_for(lambda: env.tokens_streamed(jobs) >= 24 * 5, 60, what="tokens flowing")
    victim = max(workers, key=lambda wid: len(env.held_by(wid)))
    held = env.held_by(victim)
    workers[victim].kill()
    reports = env.wait_ended(jobs, timeout=90)
    env.assert_exactly_once(reports)
    for j, rep in reports.items():
        assert rep.kind == "done:length" and rep.text == fake_completion(
            f"sharded prompt {jobs.index(j)}", 40), j
    resumed = [j for j, rep in reports.items() if len(rep.started) > 1]
    assert held and resumed, "the victim held nothing when killed: the test proved nothing"
    assert all(reports[j].started[-1].resumed_tokens > 0 for j in resumed)


def run_worker_cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenrelay.worker", *argv], cwd=str(REPO_ROOT),
                          capture_output=True, text=True, timeout=timeout)


def test_worker_and_admin_refuse_a_shard_count_the_queue_was_not_registered_with(r):
    r.hset(KEYS.config, SHARDS_FIELD, 3)
    common = ["--redis-url", r.url, "--namespace", KEYS.namespace, "--queue", KEYS.queue]
    done = run_worker_cli("--model", "fake:", "--device", "cpu", "--worker-id", "w9",
                          "--shards", "2", *common)
    assert done.returncode == 78, done.stderr[-2000:]
    assert "registered with 3 shards" in done.stderr and "--shards" in done.stderr
    assert not r.exists(KEYS.heartbeat("w9"))
    assert admin.main([*common, "--shards", "2", "pending"]) == 78


def test_cluster_on_against_a_plain_server_is_a_configuration_error(r):
    common = ["--redis-url", r.url, "--cluster", "on"]
    done = run_worker_cli("--model", "fake:", "--device", "cpu", "--worker-id", "w9", *common)
    assert done.returncode == 78, done.stderr[-2000:]
    assert "not a Redis Cluster node" in done.stderr and "--cluster auto" in done.stderr
    health = run_worker_cli("health", "--worker-id", "w9", *common)
    assert health.returncode == 1 and "not a Redis Cluster node" in health.stderr
    assert admin.main([*common, "workers"]) == 78
