"""Prefix affinity when the preferred worker dies: ``tokenrelay worker`` processes (FakeEngine),
one SIGKILLed mid-conversation. The next turn is served by the other worker, and the jobs that
were in the dead worker's affinity stream -- running there (read, not acknowledged) and waiting
(unread) -- each finish exactly once elsewhere (the fault harness's stream oracle). On one
Redis with one shard and with three, and on a 3-master Redis Cluster (one cluster for the
module, a namespace per test) with a 3-shard queue."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import pytest

from tokenrelay.producer_sdk import AsyncClient
from tokenrelay.producer_sdk.core.affinity import rank
from tokenrelay.protocol.keys import GROUP, PAYLOAD_FIELD, key_slot, parse_dedupe_record
from tests.fault_harness import FaultEnv, ids_on_shard, pending_summary, wait_for
from tokenrelay.worker.connection import connect
from tokenrelay.worker.pending import PendingList

pytestmark = pytest.mark.timeout(180)

MODEL = "fake:step_delay=0.05,max_num_seqs=2"
_namespaces = itertools.count()


@pytest.fixture
def env(tmp_path):
    e = FaultEnv(tmp_path)
    try:
        yield e
    finally:
        e.close()


@pytest.fixture
def env3(tmp_path):
    """A 3-shard queue on one Redis."""
    e = FaultEnv(tmp_path, shards=3)
    try:
        yield e
    finally:
        e.close()


@pytest.fixture
def cenv(redis_cluster, tmp_path):
    """A 3-shard queue on the 3-master cluster, in a namespace of its own."""
    e = FaultEnv(tmp_path, namespace=f"af{next(_namespaces)}", shards=3, cluster=redis_cluster)
    try:
        yield e
    finally:
        e.close()


def started_on(env: FaultEnv, job_id: str) -> list[str]:
    return [ev.worker_id for ev in env.streams([job_id])[job_id].started]


def routed_to(env: FaultEnv, job_id: str) -> str:
    """The stream the job's dedupe record names (where it was enqueued or moved to)."""
    return parse_dedupe_record(env.r.get(env.keys.dedupe(job_id)))[0]


def key_won_by(worker: str, workers: list[str]) -> str:
    return next(f"conv-{i}" for i in range(100) if rank(f"conv-{i}", workers)[0] == worker)


def per_shard(env: FaultEnv, prefix: str, n: int) -> list[str]:
    """``n`` job ids on every shard of the env's queue, shard by shard."""
    return [j for s in range(env.keys.shards) for j in ids_on_shard(env.keys, s, prefix, n)]


def keyed(ids: list[str], key: str, text: str) -> list[dict]:
    return [{"prompt": f"{text} {j}", "job_id": j, "routing_key": key} for j in ids]


def test_killed_preferred_worker_next_turn_elsewhere_and_its_jobs_end_once(env):
    wa = env.worker("wa", model=MODEL)
    env.worker("wb", model=MODEL)
    key = next(f"conv-{i}" for i in range(100) if rank(f"conv-{i}", ["wa", "wb"])[0] == "wa")
    keys = env.keys
    client = env.client(affinity_ttl_s=0)

    turn1 = client.submit("turn 1", routing_key=key, max_tokens=3)
    turn1.result(timeout=30)
    assert started_on(env, turn1.id) == ["wa"]

    # six jobs of the conversation: two run on wa (its capacity), four wait in its stream
    jobs = client.submit_many([{"prompt": f"turn 2.{i}", "routing_key": key} for i in range(6)],
                              max_tokens=40, block=False)
    ids = [j.id for j in jobs]
    assert {parse_dedupe_record(env.r.get(keys.dedupe(j)))[0] for j in ids} == {
        keys.affinity("wa", 0)}
    wait_for(lambda: all(env.tokens_streamed([j]) >= 3 for j in ids[:2]), 20,
             what="two jobs streaming on wa")
    assert env.r.xlen(keys.affinity("wa", 0)) == 6

    wa.kill()                                            # SIGKILL: no drain, no goodbye
    wait_for(lambda: not env.r.exists(keys.heartbeat("wa")), 10, what="wa's heartbeat expired")
    turn3 = client.submit("turn 3", routing_key=key, max_tokens=3)
    assert turn3.result(timeout=30).text
    assert started_on(env, turn3.id) == ["wb"]
    assert parse_dedupe_record(env.r.get(keys.dedupe(turn3.id)))[0] == keys.affinity("wb", 0)

    reports = env.wait_ended(ids, 60)
    env.assert_exactly_once(reports)
    assert all(r.kind == "done:length" and len(r.token_ids) == 40 for r in reports.values())
    for j in ids[:2]:                                    # resumed from their streams on wb
        assert started_on(env, j) == ["wa", "wb"]
    for j in ids[2:]:                                    # moved unread to the shared lane
        assert started_on(env, j) == ["wb"]
    wait_for(lambda: not env.r.exists(keys.affinity("wa", 0)), 10,
             what="the dead worker's emptied stream deleted")
    assert env.r.xpending(keys.affinity("wb", 0), GROUP)["pending"] == 0
    assert not pending_summary(env.r, keys)


def test_sharded_queue_same_key_same_worker_then_elsewhere_when_it_dies(env3):
    """A 3-shard queue: jobs of one key but different ids (so different shards) all go to the
    preferred worker's stream of their own shard; killed mid-conversation, its running and
    unread jobs of every shard finish once on the other worker, and so does the next turn."""
    env = env3
    keys = env.keys
    wa = env.worker("wa", model=MODEL)
    env.worker("wb", model=MODEL)
    key = key_won_by("wa", ["wa", "wb"])
    client = env.client(affinity_ttl_s=0)

    turn1 = per_shard(env, "t1", 1)
    for job in client.submit_many(keyed(turn1, key, "turn 1"), max_tokens=3):
        job.result(timeout=30)
    assert [routed_to(env, j) for j in turn1] == [keys.affinity("wa", s) for s in range(3)]
    assert all(started_on(env, j) == ["wa"] for j in turn1)

    turn2 = per_shard(env, "t2", 2)         # two run on wa (its capacity), four wait
    client.submit_many(keyed(turn2, key, "turn 2"), max_tokens=40, block=False)
    assert [routed_to(env, j) for j in turn2] == [keys.affinity("wa", keys.shard_of(j))
                                                  for j in turn2]
    wait_for(lambda: sum(env.tokens_streamed([j]) >= 3 for j in turn2) == 2, 20,
             what="two jobs streaming on wa")
    assert sum(env.r.xlen(keys.affinity("wa", s)) for s in range(3)) == 6

    wa.kill()                                            # SIGKILL: no drain, no goodbye
    wait_for(lambda: not env.r.exists(keys.heartbeat("wa")), 10, what="wa's heartbeat expired")
    (turn3,) = ids_on_shard(keys, 2, "t3", 1)
    job3 = client.submit("turn 3", job_id=turn3, routing_key=key, max_tokens=3)
    assert job3.result(timeout=30).text
    assert started_on(env, turn3) == ["wb"] and routed_to(env, turn3) == keys.affinity("wb", 2)

    reports = env.wait_ended(turn2, 60)
    env.assert_exactly_once(reports)
    assert all(r.kind == "done:length" and len(r.token_ids) == 40 for r in reports.values())
    runs = sorted(started_on(env, j) for j in turn2)
    assert runs == [["wa", "wb"]] * 2 + [["wb"]] * 4, runs   # 2 resumed, 4 moved unread
    wait_for(lambda: not any(env.r.exists(keys.affinity("wa", s)) for s in range(3)), 10,
             what="the dead worker's emptied streams deleted on every shard")


def test_cluster_routed_jobs_land_in_their_shards_affinity_stream_and_finish(cenv,
                                                                           redis_cluster):
    """On a 3-master cluster: each routed job is enqueued on the chosen worker's stream of the
    job's shard (the slot of the job's dedupe record and lanes, on that shard's master), by
    the sync and the async client, and runs there once; a job without a key takes its lane."""
    env = cenv
    keys = env.keys
    env.worker("w1")
    env.worker("w2")
    key = key_won_by("w2", ["w1", "w2"])
    client = env.client(affinity_ttl_s=0)
    ids = per_shard(env, "c", 2)
    jobs = client.submit_many(keyed(ids, key, "routed"), max_tokens=8)
    plain = client.submit("plain", job_id=ids_on_shard(keys, 1, "plain", 1)[0], max_tokens=8)

    async def async_submit() -> str:
        async with AsyncClient(env.url, queue=keys.queue, namespace=keys.namespace,
                               affinity_ttl_s=0) as ac:
            return (await ac.submit("async", job_id=ids_on_shard(keys, 0, "async", 1)[0],
                                    routing_key=key, max_tokens=8)).id
    routed = ids + [asyncio.run(async_submit())]
    for j in routed:
        stream = keys.affinity("w2", keys.shard_of(j))
        assert routed_to(env, j) == stream
        assert key_slot(stream) == key_slot(keys.lane("default", keys.shard_of(j)))
    masters = {redis_cluster.master_of_slot(key_slot(keys.affinity("w2", s))) for s in range(3)}
    assert len(masters) == 3, "the worker's streams should lie on the shards' masters"
    assert routed_to(env, plain.id) == keys.lane("default", 1)

    reports = env.wait_ended(routed + [plain.id], 60)
    env.assert_exactly_once(reports)
    assert all(reports[j].kind == "done:length" for j in routed + [plain.id])
    assert all(started_on(env, j) == ["w2"] for j in routed)
    assert [j.id for j in jobs] == ids


def test_cluster_sweep_after_sigkill_moves_unread_routed_jobs(cenv):
    """On a 3-master cluster: the preferred worker runs one job and holds the others of its key
    unread in its streams on every shard when it is SIGKILLed; the other worker's sweep moves
    the unread ones (per shard, one slot per script) to their shard's shared lane, reclaims the
    running one past the lease, and every job ends exactly once."""
    env = cenv
    keys = env.keys
    wa = env.worker("wa", model="fake:step_delay=0.05,max_num_seqs=1")
    env.worker("wb", model=MODEL)
    key = key_won_by("wa", ["wa", "wb"])
    client = env.client(affinity_ttl_s=0)
    ids = per_shard(env, "s", 2)
    client.submit_many(keyed(ids, key, "conv"), max_tokens=40, block=False)
    assert all(routed_to(env, j) == keys.affinity("wa", keys.shard_of(j)) for j in ids)
    wait_for(lambda: any(env.tokens_streamed([j]) >= 3 for j in ids), 20,
             what="one job streaming on wa")

    wa.kill()
    reports = env.wait_ended(ids, 90)
    env.assert_exactly_once(reports)
    assert all(r.kind == "done:length" and len(r.token_ids) == 40 for r in reports.values())
    moved = [j for j in ids if started_on(env, j) == ["wb"]]
    assert len(moved) >= 4, [started_on(env, j) for j in ids]
    for j in moved:             # its dedupe record follows it to its shard's shared lane
        assert routed_to(env, j) == keys.lane("default", keys.shard_of(j))
    wait_for(lambda: not any(env.r.exists(keys.affinity("wa", s)) for s in range(3)), 10,
             what="the dead worker's emptied streams deleted on every shard")


@pytest.mark.parametrize("where", ["env3", "cenv"])
def test_idle_read_wakes_on_own_affinity_stream_of_any_shard_and_reads_it_first(where, request):
    """The idle worker's blocking read names its own affinity streams (beside every lane on one
    Redis, per shard on a cluster): a routed job on any shard wakes it at once; and of what
    several shards' reads bring, the affinity entry is kept first (before an urgent one)."""
    env = request.getfixturevalue(where)
    keys = env.keys
    client = connect(env.url, 5000)                 # the worker's own client (RESP2)
    request.addfinalizer(client.close)
    pending = PendingList(client, keys, "w1")
    pending.ensure_groups()
    for s in (2, 0, 1):
        got: list = []
        waiter = threading.Thread(target=lambda: got.extend(pending.wait_new(5000)))
        waiter.start()
        time.sleep(0.3)                         # blocked in its reads
        t0 = time.monotonic()
        env.r.xadd(keys.affinity("w1", s), {PAYLOAD_FIELD: b"routed"})
        waiter.join(6)
        woke_s = time.monotonic() - t0
        assert [(e.lane, e.shard, e.lane_key) for e in got] == [
            ("affinity", s, keys.affinity("w1", s))]
        assert woke_s < 1.0, f"woke after {woke_s:.2f} s: not by the routed job"
    pending.reset()                             # no blocking read left to take the next ones
    env.r.xadd(keys.lane("urgent", 0), {PAYLOAD_FIELD: b"urgent"})
    env.r.xadd(keys.affinity("w1", 1), {PAYLOAD_FIELD: b"routed"})
    got = sorted(pending.read_new(1), key=pending.lanes.urgency)
    assert [(e.lane, e.payload) for e in got] == [("affinity", b"routed"), ("urgent", b"urgent")]
