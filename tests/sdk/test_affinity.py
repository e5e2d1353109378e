"""Prefix-affinity routing, producer side (producer_sdk/core/affinity.py): the rendezvous choice,
which heartbeats qualify, the backlog bound and TTL, the wire field and its OpenAI spelling, and
where the enqueue script puts a keyed job on a real redis-server (workers are faked here by
writing the heartbeat and creating the stream as a worker does; tests/worker/test_affinity.py
runs real ones)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections import Counter

import msgpack
import pytest
import redis

from tokenrelay.producer_sdk import AsyncClient, Client
from tokenrelay.producer_sdk.core.affinity import AffinityRouter, LiveWorker, live_worker, rank
from tokenrelay.producer_sdk.core.effects import run
from tokenrelay.producer_sdk.errors import InvalidRequest, QueueFull
from tokenrelay.producer_sdk.openai.format import CHAT_URL, LineError, body_to_request, parse_request
from tokenrelay.producer_sdk.jobs.payloads import Prepared
from tokenrelay.protocol.errors import ProtocolError
from tokenrelay.protocol.heartbeat import FIELDS, Heartbeat
from tokenrelay.protocol.keys import GROUP, Keys, parse_dedupe_record
from tokenrelay.protocol.wire import JobRequest, MAX_ROUTING_KEY_LEN, decode_job, encode_job
from tests.sdk_helpers import env_with_repo, sdk_redis, sdk_url  # noqa: F401  (fixtures)

KEYS = Keys()


# ------------------------------------------------------------------------------------------
# rendezvous hashing
# ------------------------------------------------------------------------------------------

def test_rank_is_deterministic_and_spreads_keys_evenly():
    workers = [f"w{i}" for i in range(4)]
    first = Counter(rank(f"conv-{k}", workers)[0] for k in range(8000))
    assert set(first) == set(workers)
    assert all(1700 <= n <= 2300 for n in first.values()), first     # 2000 each, +-15 %
    assert rank("conv-1", workers) == rank("conv-1", list(reversed(workers)))


def test_a_worker_leaving_moves_only_the_keys_it_won():
    workers = ["a", "b", "c", "d"]
    before = {k: rank(str(k), workers)[0] for k in range(2000)}
    after = {k: rank(str(k), ["a", "b", "d"])[0] for k in range(2000)}
    moved = [k for k in before if before[k] != after[k]]
    assert moved and all(before[k] == "c" for k in moved)
    # ... each to its runner-up, the same worker every producer computes
    assert all(after[k] == rank(str(k), workers)[1] for k in moved)


# ------------------------------------------------------------------------------------------
# which heartbeats qualify
# ------------------------------------------------------------------------------------------

def beat(**fields: object) -> Heartbeat:
    """A heartbeat as the router reads it: HMGET of every field, these as given (None:
    absent), the others absent."""
    base = {"queue": "default", "engine_loaded": "1", "draining": "0", "affinity": "1",
            "held": "3", "affinity_queued": "2"}
    base.update({k: v for k, v in fields.items()})
    return Heartbeat.from_row([None if base.get(f) is None else str(base[f]).encode()
                               for f in FIELDS])


def test_live_worker_reads_the_heartbeat():
    assert live_worker("default", "w", beat()) == LiveWorker("w", 5)
    assert live_worker("default", "w", None) is None                     # hash gone
    assert Heartbeat.from_row([None] * len(FIELDS)) is None
    assert live_worker("default", "w", beat(draining="1")) is None
    assert live_worker("default", "w", beat(engine_loaded="0")) is None
    assert live_worker("default", "w", beat(affinity=None)) is None   # an older worker
    assert live_worker("other", "w", beat()) is None
    assert live_worker("default", "w", beat(held="x", affinity_queued=None)).backlog == 0


# ------------------------------------------------------------------------------------------
# the router without Redis
# ------------------------------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def prepared(job_id: str, key: object = None, queue: object = None) -> Prepared:
    return Prepared(job_id, "default", b"", True, queue, routing_key=key)


def test_router_picks_the_top_ranked_worker_until_its_backlog_bound():
    clock = Clock()
    router = AffinityRouter(KEYS, ttl_s=1.0, max_backlog=5, clock=clock)
    jobs = [prepared(f"j{i}", "conv") for i in range(4)] + [prepared("plain")]
    assert router.stale(jobs) == ["default"]
    best = rank("conv", ["a", "b"])[0]
    router.store("default", {"a": LiveWorker("a", 2), "b": LiveWorker("b", 2)})
    assert router.stale(jobs) == []
    router.assign(jobs)
    # backlog 2, bound 5: three more fit, the fourth keyed job goes to the shared lanes
    assert [j.affinity for j in jobs] == [best, best, best, None, None]
    clock.t += 1.0
    assert router.stale(jobs) == ["default"]        # the snapshot expired: read again


def test_router_without_live_workers_leaves_jobs_on_the_shared_lanes():
    router = AffinityRouter(KEYS, ttl_s=1.0, max_backlog=5)
    router.store("default", {})
    jobs = [prepared("j1", "conv")]
    router.assign(jobs)
    assert jobs[0].affinity is None


def test_router_keeps_a_snapshot_per_queue():
    router = AffinityRouter(KEYS, ttl_s=1.0, max_backlog=5)
    router.store("default", {"a": LiveWorker("a", 0)})
    router.store("other", {"z": LiveWorker("z", 0)})
    jobs = [prepared("j1", "conv"), prepared("j2", "conv", queue="other")]
    router.assign(jobs)
    assert [j.affinity for j in jobs] == ["a", "z"]


class Unreachable:
    """A redis-py client whose every round trip fails as a failing-over cluster's does."""

    def pipeline(self, transaction: bool = False) -> "Unreachable":
        return self

    def __getattr__(self, name: str) -> object:
        def queued(*args: object, **kwargs: object) -> "Unreachable":
            return self
        return queued

    def execute(self, *args: object, **kwargs: object) -> list:
        raise redis.ConnectionError("connection refused")


def test_a_failed_heartbeat_read_keeps_the_last_view_or_routes_to_the_shared_lanes():
    clock = Clock()
    router = AffinityRouter(KEYS, ttl_s=1.0, max_backlog=5, clock=clock)
    fresh = [prepared("j1", "conv")]
    run(router.route_plan(fresh), Unreachable)          # never read: the shared lanes
    assert fresh[0].affinity is None
    router.store("default", {"a": LiveWorker("a", 0)})
    clock.t += 5.0                                       # expired, and the re-read fails
    stale = [prepared("j2", "conv")]
    run(router.route_plan(stale), Unreachable)
    assert stale[0].affinity == "a"


# ------------------------------------------------------------------------------------------
# the wire field and its OpenAI spelling
# ------------------------------------------------------------------------------------------

def test_routing_key_is_a_bounded_string_in_the_payload():
    job = JobRequest(job_id="j", prompt="p", routing_key="k" * MAX_ROUTING_KEY_LEN)
    assert decode_job(encode_job(job)).routing_key == "k" * MAX_ROUTING_KEY_LEN
    for bad in ("", "k" * (MAX_ROUTING_KEY_LEN + 1), 7):
        obj = {"v": 1, "job_id": "j", "prompt": "p", "routing_key": bad}
        with pytest.raises(ProtocolError) as err:
            decode_job(msgpack.packb(obj))
        assert err.value.field == "routing_key", bad


def test_prompt_cache_key_is_the_routing_key_and_user_is_not():
    body = {"messages": [{"role": "user", "content": "hi"}], "prompt_cache_key": "conv-9",
            "user": "alice"}
    req = parse_request(CHAT_URL, body, streaming=True)
    assert req.kwargs["routing_key"] == "conv-9" and req.user == "alice"
    only_user = parse_request(CHAT_URL, {**body, "prompt_cache_key": None}, streaming=True)
    assert "routing_key" not in only_user.kwargs
    for bad in ("", 5, "k" * (MAX_ROUTING_KEY_LEN + 1)):
        with pytest.raises(LineError) as err:
            parse_request(CHAT_URL, {**body, "prompt_cache_key": bad}, streaming=False)
        assert err.value.param == "prompt_cache_key"


# ------------------------------------------------------------------------------------------
# on a real redis-server, with workers faked by their heartbeats and streams
# ------------------------------------------------------------------------------------------

def fake_worker(r, worker_id: str, stream: bool = True, keys: Keys = KEYS,
                **fields: object) -> None:
    """What a worker writes for routing: its registry entry and heartbeat; and its stream on
    every shard with the consumer group (unless ``stream`` is False: a worker that deleted
    them)."""
    hb = {"queue": "default", "engine_loaded": 1, "draining": 0, "affinity": 1, "held": 0,
          "affinity_queued": 0, **fields}
    r.hset(keys.heartbeat(worker_id), mapping=hb)
    r.pexpire(keys.heartbeat(worker_id), 5000)
    r.zadd(keys.workers, {worker_id: 1})
    for s in range(keys.shards) if stream else ():
        r.xgroup_create(keys.affinity(worker_id, s), GROUP, id="0", mkstream=True)


def where(r, job_id: str, keys: Keys = KEYS) -> str:
    lane, entry_id = parse_dedupe_record(r.get(keys.dedupe(job_id)))
    assert r.xrange(lane, entry_id, entry_id), "the dedupe record names an entry that is not there"
    return lane


def test_keyed_jobs_go_to_the_chosen_workers_stream_and_others_to_their_lanes(sdk_url):
    with Client(sdk_url) as c:
        r = c.redis
        for w in ("wa", "wb", "wc"):
            fake_worker(r, w)
        keyed = [c.submit("hi", job_id=f"k{i}", routing_key=f"conv-{i % 6}") for i in range(12)]
        plain = c.submit("hi", job_id="plain", priority=-1)
        for i, job in enumerate(keyed):
            assert where(r, job.id) == KEYS.affinity(rank(f"conv-{i % 6}", ["wa", "wb", "wc"])[0], 0)
        assert where(r, plain.id) == KEYS.lane("urgent")
        # resubmitting a known id is deduped, wherever its entry lives
        again = c.submit("hi", job_id="k0", routing_key="conv-0")
        assert again.reattached and sum(r.xlen(KEYS.affinity(w, 0)) for w in ("wa", "wb", "wc")) == 12


def test_a_deleted_affinity_stream_sends_the_job_to_its_own_lane(sdk_url):
    """The enqueue script's fallback: the router still believes in the worker (a stale view),
    but its stream is gone, so the job lands in the shared lane of its priority."""
    with Client(sdk_url) as c:
        fake_worker(c.redis, "gone", stream=False)
        job = c.submit("hi", job_id="late", routing_key="conv", priority=5)
        assert where(c.redis, job.id) == KEYS.lane("bulk")
        assert not c.redis.exists(KEYS.affinity("gone", 0))


def test_draining_dead_or_busy_workers_are_passed_over(sdk_url):
    with Client(sdk_url, affinity_max_backlog=4) as c:
        r = c.redis
        fake_worker(r, "drains", draining=1)
        fake_worker(r, "dead")
        r.delete(KEYS.heartbeat("dead"))            # registered, its heartbeat expired
        fake_worker(r, "busy", held=3, affinity_queued=0)
        jobs = c.submit_many([{"prompt": "p", "job_id": f"b{i}", "routing_key": "one"}
                              for i in range(3)])
        # only "busy" qualifies; with backlog 3 and bound 4 it takes one job, then the lane
        assert [where(r, j.id) for j in jobs] == [KEYS.affinity("busy", 0)] + [KEYS.lane("default")] * 2


def test_async_client_routes_the_same_way(sdk_url):
    r = redis.Redis.from_url(sdk_url)
    for w in ("wa", "wb"):
        fake_worker(r, w)

    async def go() -> list[str]:
        async with AsyncClient(sdk_url) as c:
            return [(await c.submit("hi", job_id=f"a{i}", routing_key=f"c{i}")).id
                    for i in range(6)]
    for i, job_id in enumerate(asyncio.run(go())):
        assert where(r, job_id) == KEYS.affinity(rank(f"c{i}", ["wa", "wb"])[0], 0)
    r.close()


def test_submit_rejects_a_bad_routing_key_before_enqueue(sdk_url):
    with Client(sdk_url) as c:
        with pytest.raises(InvalidRequest) as err:
            c.submit("hi", routing_key="")
        assert err.value.field == "routing_key"
        assert c.queue_depth() == 0


def test_a_batch_lines_prompt_cache_key_routes_its_job(sdk_url):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "prompt_cache_key": "sys-prompt-7", "user": "bob"}
    with Client(sdk_url) as c:
        fake_worker(c.redis, "wa")
        p = c.prepare(body_to_request(CHAT_URL, body), job_id="line-1", stream=False)
        assert p.routing_key == "sys-prompt-7"
        assert decode_job(p.payload).routing_key == "sys-prompt-7"
        c.enqueue([p], block=False)
        assert where(c.redis, "line-1") == KEYS.affinity("wa", 0)


def test_cli_submit_routing_key(sdk_url):
    r = redis.Redis.from_url(sdk_url)
    fake_worker(r, "wa")                    # advertised, never answers: the CLI times out
    res = subprocess.run([sys.executable, "-m", "tokenrelay.producer_sdk", "submit", "hi", "--redis-url",
                          sdk_url, "--routing-key", "conv-1", "--job-id", "cli-1", "--timeout",
                          "0.2"], capture_output=True, text=True, timeout=60, env=env_with_repo())
    assert "job cli-1" in res.stderr and res.returncode != 0
    assert where(r, "cli-1") == KEYS.affinity("wa", 0)
    r.close()


def test_status_of_a_job_waiting_in_an_affinity_stream(sdk_url):
    with Client(sdk_url) as c:
        fake_worker(c.redis, "wa")
        for i in range(3):
            c.submit("hi", job_id=f"s{i}", routing_key="conv")
        c.submit("hi", job_id="shared")
        st = c.statuses(["s0", "s2", "shared"])
    assert [(s.state, s.lane, s.position) for s in st] == [
        ("queued", "affinity", 0), ("queued", "affinity", 2), ("queued", "default", 0)]


KEYS3 = Keys(shards=3)


def test_keyed_jobs_of_a_three_shard_queue_go_to_the_workers_stream_of_their_shard(sdk_url):
    """One key, job ids on every shard: each job on the chosen worker's stream of its own
    shard; where that worker's stream of one shard is gone, that shard's job takes its lane."""
    with Client(sdk_url, shards=3, affinity_ttl_s=0) as c:
        r = c.redis
        for w in ("wa", "wb"):
            fake_worker(r, w, keys=KEYS3)
        best = rank("conv", ["wa", "wb"])[0]
        ids = [f"k{i}" for i in range(12)]
        assert {KEYS3.shard_of(j) for j in ids} == {0, 1, 2}
        c.submit_many([{"prompt": "hi", "job_id": j, "routing_key": "conv"} for j in ids])
        assert [where(r, j, KEYS3) for j in ids] == [KEYS3.affinity(best, KEYS3.shard_of(j))
                                                    for j in ids]
        r.delete(KEYS3.affinity(best, 1))
        late = [f"late{i}" for i in range(12)]
        c.submit_many([{"prompt": "hi", "job_id": j, "routing_key": "conv", "priority": -1}
                       for j in late])
        for j in late:
            shard = KEYS3.shard_of(j)
            assert where(r, j, KEYS3) == (KEYS3.lane("urgent", 1) if shard == 1
                                          else KEYS3.affinity(best, shard))


@pytest.mark.parametrize("shards", [1, 3])
def test_routed_jobs_are_refused_past_the_mark_but_not_counted_in_the_depth(sdk_url, shards):
    """Back-pressure with affinity: the high-water mark counts the shared lanes of every shard;
    a routed job is checked against it like any other, but waiting in an affinity stream it
    adds nothing to the depth."""
    keys = Keys(shards=shards)
    with Client(sdk_url, shards=shards, max_queued_jobs=3) as c:
        fake_worker(c.redis, "wa", keys=keys)
        routed = c.submit_many([{"prompt": "p", "routing_key": "conv"} for _ in range(5)],
                               block=False)     # one round: no QueueFull, no retry
        assert [where(c.redis, j.id, keys) for j in routed] == [
            keys.affinity("wa", keys.shard_of(j.id)) for j in routed]
        assert c.queue_depth() == 0
        c.submit_many(["p"] * 3)
        assert c.queue_depth() == 3
        with pytest.raises(QueueFull):
            c.submit("p", routing_key="conv")
        with pytest.raises(QueueFull):
            c.submit("p")
