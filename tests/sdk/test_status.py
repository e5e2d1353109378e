"""Client.status / AsyncClient.status on a real redis-server with an in-process worker (#18):
every state a job passes through, read from what Redis holds."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from tokenrelay.producer_sdk import AsyncClient, Client
from tokenrelay.producer_sdk.errors import JobFailed
from tokenrelay.protocol.keys import Keys, PAYLOAD_FIELD
from tokenrelay.protocol.wire import now_ms
from tests.fault_harness import wait_for
from tokenrelay.worker.fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def client(redis_server):
    with Client(redis_server.url) as c:
        yield c


def test_unknown_and_queued_with_lane_and_position(client):
    assert client.status("never-submitted").state == "unknown"
    jobs = [client.submit(f"p{i}", max_tokens=2, job_id=f"q{i}") for i in range(3)]
    urgent = client.submit("u", max_tokens=2, priority=-1, job_id="urgent")
    bulk = client.submit("b", max_tokens=2, priority=5, job_id="bulk")
    third = client.status(jobs[2].id)
    assert (third.state, third.lane) == ("queued", "default")
    assert third.position == 1 + 2           # the urgent job, then q0 and q1
    assert client.status(urgent.id).position == 0
    assert client.status(bulk.id).position == 1 + 3          # every job of the other lanes
    client.cancel(jobs[0].id)
    assert client.status(jobs[0].id).cancel_requested


def test_running_done_cancelled_failed_and_expired(client, redis_server, start_worker):
    r = redis_server.client()
    start_worker(engine=FakeEngine(step_delay=0.02))
    long = client.submit("long", max_tokens=400, temperature=0.0, job_id="long")
    short = client.submit("short", max_tokens=3, temperature=0.0, job_id="short")
    wait_for(lambda: client.status(long.id).tokens >= 3, 20, what="long running")
    running = client.status(long.id)
    assert (running.state, running.worker_id, running.deliveries) == ("running", "w1", 1)
    short.result(timeout=20)
    done = client.status(short.id)
    assert (done.state, done.finish_reason, done.tokens) == ("done", "length", 3)
    long.cancel()
    long.result(timeout=20)
    assert client.status(long.id).state == "cancelled"
    r.xadd(Keys().lane("default"), {PAYLOAD_FIELD: msgpack.packb(
        {"v": 1, "job_id": "bad", "prompt": 5})})
    wait_for(lambda: client.status("bad").state == "failed", 20, what="bad failed")
    bad = client.status("bad")
    assert bad.error_code == "invalid_request" and "prompt" in bad.message
    r.xadd(Keys().lane("default"), {PAYLOAD_FIELD: msgpack.packb(     # its deadline passed
        {"v": 1, "job_id": "late", "prompt": "late", "deadline_ms": now_ms() - 1000})})
    wait_for(lambda: client.status("late").state == "expired", 20, what="deadline passed")
    assert client.status("late").error_code == "expired"
    with pytest.raises(JobFailed) as err:        # an expired deadline is a result, not "lost"
        client.get("late").result(timeout=5)
    assert err.value.code == "expired"
    r.delete(Keys().results(short.id))              # what the result TTL does
    assert client.status(short.id).state == "expired"
    r.close()


def test_async_status_reads_the_same(client, redis_server):
    client.submit("a", max_tokens=2, job_id="a1")
    client.submit("b", max_tokens=2, job_id="a2")

    async def main():
        async with AsyncClient(redis_server.url) as ac:
            return [await ac.status(j) for j in ("a1", "a2", "nope")]

    assert asyncio.run(main()) == [client.status(j) for j in ("a1", "a2", "nope")]


def test_many_statuses_in_the_round_trips_of_one(client, monkeypatch):
    ids = [client.submit(f"m{i}", max_tokens=2, job_id=f"m{i}").id for i in range(40)]
    one_by_one = [client.status(j) for j in ids + ["nope"]]
    pipelines = []
    real = client.redis.pipeline
    monkeypatch.setattr(client.redis, "pipeline",
                        lambda *a, **k: pipelines.append(k) or real(*a, **k))
    got = client.statuses(ids + ["nope"])
    assert got == one_by_one
    assert [s.position for s in got[:-1]] == list(range(40)) and got[-1].state == "unknown"
    # the rounds of one queued job (record, snapshot, lanes, its place), whatever the count
    assert len(pipelines) == 4, pipelines


def test_many_statuses_are_read_in_bounded_chunks(client, redis_server):
    """No round's MULTI holds Redis for more than STATUS_CHUNK jobs (#25): 50,000 ids in one
    stalled every other client; the answers are the same as one by one, in order."""
    from tokenrelay.producer_sdk.core.status import STATUS_CHUNK
    n = 2 * STATUS_CHUNK + 5
    jobs = client.submit_many([{"prompt": f"c{i}", "job_id": f"c{i}"} for i in range(n)],
                              max_tokens=2)
    ids = [j.id for j in jobs] + ["never"]
    admin = redis_server.client()
    admin.config_resetstat()
    got = client.statuses(ids)
    execs = admin.info("commandstats")["cmdstat_exec"]["calls"]
    admin.close()
    assert [s.job_id for s in got] == ids and got[-1].state == "unknown"
    assert {s.state for s in got[:-1]} == {"queued"}
    assert execs == 3                           # ceil((n + 1) / STATUS_CHUNK) MULTIs
    assert got[n - 1] == client.status(ids[n - 1])


def test_batch_status_lists_every_line(tmp_path, redis_server):
    import json
    import subprocess
    import sys

    from tokenrelay.producer_sdk.batch.lines import job_id_for
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"c{i}", "method": "POST",
                                       "url": "/v1/completions",
                                       "body": {"model": "m", "prompt": f"p{i}",
                                                "max_tokens": 2}}) + "\n"
                           for i in range(3)))
    with Client(redis_server.url) as c:
        c.submit("p0", max_tokens=2, job_id=job_id_for("my-batch", "c0"))
    out = subprocess.run([sys.executable, "-m", "tokenrelay.producer_sdk", "status", "--batch", str(src),
                          "--batch-id", "my-batch", "--redis-url", redis_server.url, "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(x) for x in out.stdout.splitlines()]
    assert [(r["custom_id"], r["state"]) for r in rows] == [
        ("c0", "queued"), ("c1", "unknown"), ("c2", "unknown")]
    assert json.loads(out.stderr.splitlines()[-1]) == {"batch_id": "my-batch", "jobs": 3,
                                                       "queued": 1, "unknown": 2,
                                                       "malformed_lines": 0}
