"""``tokenrelay admin`` (worker/admin.py) against a real redis-server (no worker process
needed)."""

from __future__ import annotations

import json

import pytest

from tokenrelay.protocol.keys import GROUP, Keys, PAYLOAD_FIELD
from tokenrelay.protocol.wire import JobRequest, decode_job, encode_job
from tests.fault_harness import REDIS_7
from tests.fixtures_redis import RedisServer
from tests.worker.redis_layer import dead_letter
from tokenrelay.worker import admin
from tokenrelay.worker.pending import PendingList

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def r(request, tmp_path):
    server = RedisServer(dir=tmp_path / "redis", binary=REDIS_7).start()
    request.addfinalizer(server.kill)
    client = server.client()
    client.url = server.url  # for the CLI tests
    yield client
    client.close()


@pytest.fixture
def keys(r) -> Keys:
    k = Keys("adm", "q")
    for lane in k.lanes():
        r.xgroup_create(lane, GROUP, id="0", mkstream=True)
    return k


def enqueue(r, keys: Keys, job_id: str, priority: int = 0) -> str:
    job = JobRequest(job_id=job_id, prompt=f"prompt of {job_id}", priority=priority)
    lane = keys.jobs_stream(priority)
    eid = r.xadd(lane, {PAYLOAD_FIELD: encode_job(job)}).decode()
    r.set(keys.dedupe(job_id), f"{lane} {eid}", ex=600)
    return eid


def poison(r, keys: Keys, job_id: str) -> str:
    """Enqueue, deliver past max_deliveries, reclaim and dead-letter it as a worker does."""
    eid = enqueue(r, keys, job_id)
    lane = keys.lane("default")
    r.xreadgroup(GROUP, "crashy", {lane: ">"}, count=1)
    r.xclaim(lane, GROUP, "crashy", 0, [eid], idle=10_000, retrycount=3, justid=True)
    w2 = PendingList(r, keys, "w2")
    (entry,) = w2.reclaim(10, 1000)
    dead_letter(r, keys, "w2", entry)
    w2.ack([entry.key])
    return eid


def run_cli(r, keys: Keys, capsys, *argv: str) -> str:
    code = admin.main(["--redis-url", r.url, "--namespace", keys.namespace, "--queue", keys.queue,
                       *argv])
    assert code == 0
    return capsys.readouterr().out


def test_pending_lists_owner_idle_time_and_deliveries(r, keys, capsys):
    e1, e2 = enqueue(r, keys, "a"), enqueue(r, keys, "u", priority=-1)
    enqueue(r, keys, "queued")
    r.xreadgroup(GROUP, "w1", {keys.lane("default"): ">"}, count=1)
    r.xreadgroup(GROUP, "w1", {keys.lane("urgent"): ">"}, count=1)
    r.xclaim(keys.lane("default"), GROUP, "w1", 0, [e1], idle=4000, retrycount=2, justid=True)
    r.set(keys.heartbeat("w1"), "alive", ex=10)
    r.set(keys.owner("a"), "w1:tok", ex=10)
    rows = admin.list_pending(r, keys)
    assert [(p.lane, p.entry_id, p.job_id) for p in rows] == [
        (keys.lane("urgent"), e2, "u"), (keys.lane("default"), e1, "a")]
    a = rows[1]
    assert a.consumer == "w1" and a.consumer_alive and a.owner == "w1:tok"
    assert a.deliveries == 2 and a.idle_ms >= 4000
    out = json.loads(run_cli(r, keys, capsys, "--json", "pending"))
    assert [row["job_id"] for row in out] == ["u", "a"]


def test_dead_letters_list_replay_and_purge(r, keys, capsys):
    poison(r, keys, "p1")
    poison(r, keys, "p2")
    letters = admin.list_dead(r, keys)
    assert [d.job_id for _, d in letters] == ["p1", "p2"]
    assert all(d.code == "poison" and d.deliveries == 4 for _, d in letters)
    assert "p1" in run_cli(r, keys, capsys, "dead", "list")

    (replayed, new_id), = admin.replay_dead(r, keys, [letters[0][0]])
    assert replayed == "p1"
    assert not r.exists(keys.results("p1"))            # the old poison error is gone
    (eid, fields), = r.xrange(keys.lane("default"), new_id, new_id)
    assert decode_job(fields[PAYLOAD_FIELD]).job_id == "p1"
    assert r.get(keys.dedupe("p1")).decode() == f"{keys.lane('default')} {new_id}"
    assert 0 < r.ttl(keys.dedupe("p1")) <= 600          # TTL kept
    assert [d.job_id for _, d in admin.list_dead(r, keys)] == ["p2"]

    assert "purged 1" in run_cli(r, keys, capsys, "dead", "purge", "--all")
    assert admin.list_dead(r, keys) == []


def test_replay_unknown_dead_letter_raises(r, keys):
    with pytest.raises(KeyError):
        admin.replay_dead(r, keys, ["1-1"])


def test_drain_sets_an_expiring_flag(r, keys, capsys):
    assert not admin.drain_requested(r, keys, "w9")
    out = run_cli(r, keys, capsys, "drain", "w9")
    assert "no live heartbeat" in out
    assert admin.drain_requested(r, keys, "w9")
    assert 0 < r.ttl(keys.drain("w9")) <= admin.DRAIN_TTL_S


def test_workers_lists_heartbeats(r, keys, capsys):
    import time
    r.zadd(keys.workers, {"w1": time.time() * 1000 - 1500})
    r.set(keys.heartbeat("w1"), "x", ex=10)
    (row,) = admin.list_workers(r, keys)
    assert row["worker_id"] == "w1" and row["heartbeat_key"] and row["last_beat_ms_ago"] >= 1500
    assert "w1" in run_cli(r, keys, capsys, "workers")
