"""The producer side of sharded queues, on one Redis and on a 3-master Redis Cluster: jobs
spread over a 3-shard queue by id, each job's keys in its shard's slot, dedupe, back-pressure
summed over the shards, results of many jobs read across slots (sync and async), status and
cancel by id, the batch runner, the registered shard count, the CLI, the model listing and the
gateway. The fake worker (tests/sdk_helpers.py) reads every shard and writes each job's events
with the keys of the shard it read it from."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest

from tokenrelay.producer_sdk import AsyncClient, Client, NotDurable, QueueFull, ShardCountMismatch
from tokenrelay.protocol.scripts import ENQUEUE
from tokenrelay.producer_sdk.batch.runner import BatchRunner
from tokenrelay.producer_sdk.core.models import list_models
from tokenrelay.protocol.keys import EVENT_FIELD, GROUP, Keys, key_slot
from tokenrelay.protocol.topology import is_cluster, make_client
from tests.sdk_helpers import FakeWorker, env_with_repo, sdk_redis  # noqa: F401

pytestmark = pytest.mark.timeout(120)

Q, SHARDS = "sq", 3
KEYS = Keys("tokenrelay", Q, SHARDS)


@pytest.fixture(scope="module")
def cluster(redis_cluster):
    return redis_cluster


def flush(url: str) -> None:
    r = make_client(url)
    try:
        if is_cluster(r):
            r.flushall(target_nodes=r.PRIMARIES)
        else:
            r.flushall()
    finally:
        r.close()


@pytest.fixture(params=["single", "cluster"])
def url(request, sdk_redis):  # noqa: F811
    """One Redis server or a 3-master cluster, emptied for each test."""
    found = sdk_redis.url if request.param == "single" else \
        request.getfixturevalue("cluster").url
    flush(found)
    yield found
    flush(found)


@pytest.fixture
def client(url):
    with Client(url, queue=Q, shards=SHARDS) as c:
        yield c


def lane_depths(r, keys: Keys = KEYS) -> list[int]:
    return [sum(r.xlen(lane) for lane in keys.lanes(s)) for s in range(keys.shards)]


def test_enqueue_spreads_jobs_over_every_shard_in_its_slot(client, url, request):
    jobs = client.submit_many([f"p{i}" for i in range(60)], max_tokens=1)
    jobs += client.submit_many([{"prompt": "u", "priority": -1}] * 3, max_tokens=1)
    r = client.redis
    depths = lane_depths(r)
    assert sum(depths) == 63 and all(d > 0 for d in depths), depths
    for job in jobs:
        shard = KEYS.shard_of(job.id)
        assert (job.queue, job.shard) == (Q, shard)
        record = r.get(KEYS.dedupe(job.id, shard)).decode()
        lane, entry = record.split(" ")
        assert key_slot(lane) == key_slot(KEYS.dedupe(job.id)) == key_slot(KEYS.tag(shard))
        assert r.xrange(lane, entry, entry)
        assert job.state.key == KEYS.results(job.id, shard)
    if "cluster" in request.node.name:      # the tags put the 3 shards on the 3 masters
        c = request.getfixturevalue("cluster")
        assert len({c.master_of_slot(key_slot(KEYS.tag(s))) for s in range(SHARDS)}) == 3


def test_a_resubmitted_job_id_is_deduped_on_its_shard(client):
    first = client.submit("a", job_id="same-id", max_tokens=1)
    again = client.submit("b", job_id="same-id", max_tokens=1, priority=4)
    many = client.submit_many([{"prompt": "c", "job_id": "same-id"}, "fresh"], max_tokens=1)
    assert not first.reattached and again.reattached and many[0].reattached
    assert first.shard == again.shard == many[0].shard
    assert sum(lane_depths(client.redis)) == 2
    r = client.redis        # masters without the script (flushed, or a replica promoted):
    r.script_flush()        # NOSCRIPT, loaded on every master, resent
    assert r.script_exists(ENQUEUE.sha) == [False]
    client.submit_many([{"prompt": "d", "job_id": f"h{i}"} for i in range(6)], max_tokens=1)
    assert sum(lane_depths(r)) == 8


def test_back_pressure_counts_the_depth_of_every_shard(client, url):
    client.set_max_queued_jobs(5)
    ids = [f"bp{i}" for i in range(5)]
    assert max(sum(1 for j in ids if KEYS.shard_of(j) == s) for s in range(SHARDS)) < 5
    client.submit_many([{"prompt": "x", "job_id": j} for j in ids], max_tokens=1)
    depths = lane_depths(client.redis)
    assert sum(depths) == 5 and max(depths) < 5     # no shard is full by itself
    with pytest.raises(QueueFull) as err:
        client.submit("one more", max_tokens=1)
    assert (err.value.depth, err.value.limit) == (5, 5)
    with Client(url, queue=Q, shards=SHARDS) as other:  # another producer sees the same sum
        with pytest.raises(QueueFull):
            other.submit_many(["a", "b"], block=False, max_tokens=1)
    client.redis.hset(KEYS.config, "max_queued_jobs", 8)
    with Client(url, queue=Q, shards=SHARDS) as fresh:   # one round spread over the shards
        with pytest.raises(QueueFull) as err:
            fresh.submit_many([f"s{i}" for i in range(10)], block=False, max_tokens=1)
        assert len(err.value.accepted) == 3 and sum(lane_depths(fresh.redis)) == 8


def test_results_of_many_jobs_across_slots_sync_and_async(client, url):
    with FakeWorker(url, queue=Q, shards=SHARDS, token_delay=0.001):
        out = client.map([f"m{i}" for i in range(30)], max_tokens=3, progress=False)
        assert [r.text for r in out] == [" t0 t1 t2"] * 30
        job = client.submit("streamed", max_tokens=4)
        assert "".join(d.text for d in job.stream(timeout=20)) == " t0 t1 t2 t3"
        jobs = client.submit_many([{"prompt": "w", "job_id": f"w{i}"} for i in range(12)],
                                  max_tokens=2)
        assert len({j.shard for j in jobs}) == SHARDS
        assert [j.result(timeout=20).text for j in jobs] == [" t0 t1"] * 12

        async def main() -> list:
            async with AsyncClient(url, queue=Q, shards=SHARDS) as ac:
                got = await ac.map([f"a{i}" for i in range(20)], max_tokens=2, progress=False)
                one = await ac.submit("async streamed", max_tokens=3)
                text = "".join([d.text async for d in one.stream(timeout=20)])
                return [r.text for r in got] + [text]
        assert asyncio.run(main()) == [" t0 t1"] * 20 + [" t0 t1 t2"]


def test_events_written_by_hand_reach_a_window_spread_over_slots(client):
    """No worker: the test writes each job's events into its result stream itself, in the
    shard's slot, and one pump over the window reads them from every slot."""
    jobs = client.submit_many([{"prompt": "h", "job_id": f"h{i}"} for i in range(9)],
                              max_tokens=1)
    assert len({j.shard for j in jobs}) == SHARDS
    r = client.redis
    for job in jobs:
        for event in ({"type": "started", "worker_id": "hand", "attempt": 1, "seed": 1},
                      {"type": "done", "finish_reason": "stop", "text": job.id,
                       "token_ids": [1]}):
            r.xadd(job.keys.results(job.id, job.shard),
                   {EVENT_FIELD: msgpack.packb(event, use_bin_type=True)})
    t0 = time.monotonic()
    done = client._run(client._pump([j.state for j in jobs], 2000))
    assert time.monotonic() - t0 < 1.5
    assert sorted(s.job_id for s, _ in done) == sorted(j.id for j in jobs)
    assert [j.result(timeout=0).text for j in jobs] == [j.id for j in jobs]


def test_status_and_cancel_by_id_find_the_jobs_shard(client, url):
    jobs = [client.submit(f"s{i}", job_id=f"st-{i}", max_tokens=2) for i in range(6)]
    urgent = client.submit("u", job_id="st-urgent", priority=-1, max_tokens=2)
    assert len({j.shard for j in jobs}) > 1
    found = client.statuses([j.id for j in jobs] + ["st-none"])
    assert [s.state for s in found] == ["queued"] * 6 + ["unknown"]
    assert {s.lane for s in found[:6]} == {"default"}
    assert client.status(urgent.id).position == 0
    assert all(s.position >= 1 for s in found[:6])      # the urgent job is ahead of them
    held = client.submit("held", job_id="st-held", priority=5, max_tokens=2)
    lane = KEYS.lane("bulk", held.shard)                 # a worker takes it (by hand)
    r = client.redis
    r.xgroup_create(lane, GROUP, id="0", mkstream=True)
    assert r.xreadgroup(GROUP, "w-hand", {lane: ">"}, count=1)
    running = client.status("st-held")
    assert (running.state, running.worker_id, running.deliveries) == ("running", "w-hand", 1)
    client.cancel("st-0")
    jobs[1].cancel()
    assert [s.cancel_requested for s in client.statuses(["st-0", "st-1", "st-2"])] == [
        True, True, False]
    with FakeWorker(url, queue=Q, shards=SHARDS):
        assert client.get("st-0").result(timeout=20).finish_reason == "cancelled"
        assert jobs[2].result(timeout=20).text == " t0 t1"
        for job in jobs[1:] + [urgent]:
            job.result(timeout=20)
        assert client.status("st-1").state == "cancelled"
        assert client.status("st-2").state == "done"

    async def main() -> list:
        async with AsyncClient(url, queue=Q, shards=SHARDS) as ac:
            await ac.cancel("st-3")
            return [s.state for s in await ac.statuses(["st-0", "st-2", "st-3"])]
    assert asyncio.run(main()) == ["cancelled", "done", "done"]


def test_leaving_a_window_early_cancels_its_jobs_on_every_shard(client):
    """``iter_completed`` cancels what is still in flight when its reader stops: one pipeline
    of cancel flags, each in its job's shard's slot."""
    done = client.keys.results("h0")
    client.redis.xadd(done, {EVENT_FIELD: msgpack.packb(
        {"type": "done", "finish_reason": "stop", "text": "early"}, use_bin_type=True)})
    source = ((i, client.prepare("x", job_id=f"h{i}", max_tokens=1)) for i in range(6))
    for tag, job in client.iter_completed(source, concurrency=6):
        assert (tag, job.result(timeout=0).text) == (0, "early")
        break
    flags = [client.redis.exists(KEYS.cancel(f"h{i}")) for i in range(6)]
    assert flags == [0, 1, 1, 1, 1, 1]
    assert len({KEYS.shard_of(f"h{i}") for i in range(1, 6)}) == SHARDS


def test_batch_runner_end_to_end_on_a_sharded_queue(client, url, tmp_path: Path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({
        "custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
        "body": {"model": "m", "prompt": f"line {i}", "max_tokens": 2}}) + "\n"
        for i in range(24)))
    with FakeWorker(url, queue=Q, shards=SHARDS):
        summary = BatchRunner(client, inp, out, batch_id="b", concurrency=8,
                              progress=False).run()
    assert (summary.succeeded, summary.failed) == (24, 0)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(x["custom_id"] for x in lines) == sorted(f"c{i}" for i in range(24))
    ids = [x["response"]["request_id"] for x in lines]
    assert len({KEYS.shard_of(j) for j in ids}) == SHARDS
    assert {s.state for s in client.statuses(ids)} == {"done"}


def test_the_registered_shard_count_is_used_and_a_mismatch_refused(url):
    r = make_client(url)
    try:
        r.hset(KEYS.config, "shards", SHARDS)
        with Client(url, queue=Q) as c:
            assert c.keys.shards == SHARDS
            job = c.submit("x", max_tokens=1)
            assert job.state.key == KEYS.results(job.id)
        with Client(url, queue=Q, shards=2) as wrong:
            with pytest.raises(ShardCountMismatch):
                wrong.submit("x", max_tokens=1)
        with Client(url, queue="unregistered") as one:
            assert one.keys.shards == 1
    finally:
        r.close()


def test_a_durable_submit_without_replicas_is_not_durable(url):
    """No replica anywhere: every node's WAIT (sent behind its enqueue commands) says 0."""
    with Client(url, queue=Q, shards=SHARDS, durable_timeout_ms=100) as c:
        with pytest.raises(NotDurable) as err:
            c.submit_many([{"prompt": "x", "job_id": f"h{i}"} for i in range(6)], durable=True,
                          max_tokens=1)
        assert (err.value.acked, err.value.asked, len(err.value.job_ids)) == (0, 1, 6)
        assert {j.shard for j in err.value.jobs} == {0, 1, 2}
        assert sum(lane_depths(c.redis)) == 6


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenrelay.producer_sdk", *args], capture_output=True,
                          text=True, timeout=60, env=env_with_repo())


def beat(r, keys: Keys, worker_id: str, model: str) -> None:
    """A live worker's heartbeat as the listing reads it (what ``tokenrelay worker`` writes)."""
    r.hset(keys.heartbeat(worker_id), mapping={"served_model_name": model, "queue": keys.queue,
                                               "engine_loaded": 1, "draining": 0,
                                               "started_ms": int(time.time() * 1000)})
    r.zadd(keys.workers, {worker_id: int(time.time() * 1000)})
    r.sadd(keys.queues, keys.queue)


def test_cli_and_model_listing_on_a_cluster(cluster):
    flush(cluster.url)
    conn = ["--redis-url", cluster.url, "--queue", Q, "--shards", str(SHARDS)]
    with FakeWorker(cluster.url, queue=Q, shards=SHARDS):
        done = cli("submit", "hi", "--job-id", "cli-1", "--max-tokens", "2", *conn)
        assert done.returncode == 0 and done.stdout == " t0 t1\n", done.stderr
    status = cli("status", "cli-1", "--json", *conn)
    assert json.loads(status.stdout)["state"] == "done", status.stderr
    queued = cli("submit", "later", "--job-id", "cli-2", "--timeout", "0.2", "--wait-for-worker",
                 *conn)
    assert queued.returncode == 5
    r = make_client(cluster.url)
    r.hset(KEYS.config, "shards", SHARDS)       # what the queue's workers register
    stats = cli("stats", "--json", "--redis-url", cluster.url, "--cluster", "on")
    (q,) = json.loads(stats.stdout)
    assert (q["queue"], q["shards"], q["depth"]) == (Q, SHARDS, 1), stats.stderr
    assert cli("cancel", "cli-2", *conn).returncode == 0
    assert r.exists(KEYS.cancel("cli-2"))
    assert cli("stats", "--redis-url", cluster.url, *conn[2:4], "--shards", "2").returncode == 2
    beat(r, KEYS, "w-a", "alpha")
    beat(r, Keys("tokenrelay", "other"), "w-b", "beta")
    models = list_models(r)
    assert {m: s.queue for m, s in models.items()} == {"alpha": Q, "beta": "other"}
    r.close()


def test_gateway_on_a_cluster(cluster):
    import httpx

    from tests.gateway.helpers import start_gateway
    flush(cluster.url)
    r = make_client(cluster.url)
    beat(r, KEYS, "w-gw", "sharded-model")
    r.hset(KEYS.config, "shards", SHARDS)
    gw = start_gateway(cluster.url)
    try:
        with FakeWorker(cluster.url, queue=Q, shards=SHARDS):
            for i in range(4):
                resp = httpx.post(f"{gw.v1}/completions", timeout=30, json={
                    "model": "sharded-model", "prompt": f"g{i}", "max_tokens": 3})
                assert resp.status_code == 200, resp.text
                assert resp.json()["choices"][0]["text"] == " t0 t1 t2"
            listed = httpx.get(f"{gw.v1}/models", timeout=10).json()
            assert [m["id"] for m in listed["data"]] == ["sharded-model"]
    finally:
        gw.server.should_exit = True
        gw.thread.join(timeout=15)
        r.close()


def test_cluster_and_shards_settings_come_from_the_environment_too(monkeypatch):
    from tokenrelay.producer_sdk.config import ClientConfig
    assert (ClientConfig().cluster, ClientConfig().shards) == (None, None)
    monkeypatch.setenv("TOKENRELAY_CLUSTER", "off")
    monkeypatch.setenv("TOKENRELAY_SHARDS", "3")
    assert (ClientConfig().cluster, ClientConfig().shards) == (False, 3)
    assert ClientConfig(cluster="on", shards=2).cluster is True
    with pytest.raises(ValueError):
        ClientConfig(cluster="maybe")
    with pytest.raises(ValueError):     # a WAIT may not outlast the socket
        ClientConfig(durable_timeout_ms=20_000)
