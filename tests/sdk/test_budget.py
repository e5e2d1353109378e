"""Token-budget back-pressure at the producer, on a real redis-server: a job's cost is admitted
against its shard's share of ``max_queued_tokens`` in the enqueue script, huge jobs are refused
while small ones still enter, one job always fits an empty queue, a blocking submit waits for
room, and ``worker admin recount-budget`` repairs a counter that drifted."""

from __future__ import annotations

import asyncio
import threading
import time

import msgpack
import pytest
import redis

from tokenrelay.producer_sdk import AsyncClient, Client, QueueFull
from tokenrelay.protocol.budget import job_cost
from tokenrelay.protocol.keys import COST_FIELD, GROUP, PAYLOAD_FIELD, Keys
from tests.sdk_helpers import sdk_redis, sdk_url  # noqa: F401
from tokenrelay.worker.admin import main as admin_main
from tokenrelay.worker.admin import recount_budget

pytestmark = pytest.mark.timeout(60)
HUGE = "x" * 2400           # 800 prompt tokens: with max_tokens 200, a cost of 1000


def counter(r: redis.Redis, keys: Keys, shard: int = 0) -> int:
    return int(r.get(keys.budget(shard)) or 0)


def entry_costs(r: redis.Redis, keys: Keys) -> dict[str, int]:
    """job id -> the cost stored in its entry, over every lane of every shard."""
    out = {}
    for lane in keys.lanes():
        for _, f in r.xrange(lane):
            out[msgpack.unpackb(f[PAYLOAD_FIELD])["job_id"]] = int(f[COST_FIELD])
    return out


def test_huge_jobs_are_refused_while_small_ones_still_enter(sdk_url):
    r = redis.Redis.from_url(sdk_url)
    with Client(sdk_url, max_queued_tokens=2500) as c:
        keys = c.keys
        accepted, refused = [], 0
        for i in range(12):                     # a burst: huge and small jobs interleaved
            try:
                accepted.append(c.submit(HUGE, max_tokens=200, job_id=f"huge-{i}"))
            except QueueFull as exc:
                refused += 1
                assert exc.reason == "token budget" and exc.token_limit == 2500
                assert exc.tokens is not None and exc.tokens + 1000 > 2500
                assert "max_queued_tokens" in str(exc)
            accepted.append(c.submit("small", max_tokens=20, job_id=f"small-{i}"))
        huge = [j for j in accepted if j.id.startswith("huge")]
        assert len(huge) == 2 and refused == 10         # 2 x 1000 fit in 2500, then no more
        assert sum(j.id.startswith("small") for j in accepted) == 12    # 12 x 22 still fit
        costs = entry_costs(r, keys)
        assert costs["huge-0"] == 1000 and costs["small-0"] == 22
        assert counter(r, keys) == sum(costs.values()) == 2 * 1000 + 12 * 22
        # known jobs are not admitted twice, and the job-count bound is still a second limit
        assert c.submit(HUGE, max_tokens=200, job_id="huge-0").reattached
        assert counter(r, keys) == 2264
    with Client(sdk_url, max_queued_jobs=14) as c, pytest.raises(QueueFull) as err:
        c.submit("one more", max_tokens=1)
    assert err.value.reason == "high-water mark"
    r.close()


def test_one_job_always_fits_an_empty_queue_and_the_shared_budget_is_read(sdk_url):
    r = redis.Redis.from_url(sdk_url)
    with Client(sdk_url) as setter:
        setter.set_max_queued_tokens(500)
    with Client(sdk_url) as c:
        big = c.submit(HUGE, max_tokens=5000)            # 5800 > 500, but the queue is empty
        assert counter(r, c.keys) == job_cost(msgpack.unpackb(big.request.payload)) == 5800
        with pytest.raises(QueueFull) as err:
            c.submit("tiny", max_tokens=1)
        assert (err.value.reason, err.value.tokens, err.value.token_limit) == \
            ("token budget", 5800, 500)
    r.close()


def test_shards_split_the_budget_and_each_admits_in_its_own_slot(sdk_url):
    r = redis.Redis.from_url(sdk_url)
    with Client(sdk_url, shards=2, max_queued_tokens=1000) as c:
        keys = c.keys
        jobs = [c.submit("abc", max_tokens=99, job_id=f"s{i}") for i in range(8)]   # cost 100
        by_shard = [sum(j.shard == s for j in jobs) for s in (0, 1)]
        assert [counter(r, keys, s) for s in (0, 1)] == [100 * n for n in by_shard]
        refused = 0
        for i in range(20):
            try:
                c.submit("abc", max_tokens=99, job_id=f"more{i}")
            except QueueFull as exc:
                refused += 1
                assert exc.token_limit == 500            # each shard's share of 1000
        assert refused > 0 and all(counter(r, keys, s) <= 500 for s in (0, 1))
    r.close()


def test_a_blocking_submit_waits_for_budget_room(sdk_url):
    r = redis.Redis.from_url(sdk_url)
    with Client(sdk_url, max_queued_tokens=1000) as c:
        c.submit(HUGE, max_tokens=190)                   # 990 of 1000
        keys = c.keys

        def release() -> None:                           # what the job's terminal write does
            time.sleep(0.5)
            r.decrby(keys.budget(), 990)
        t = threading.Thread(target=release)
        t0 = time.monotonic()
        t.start()
        jobs = c.submit_many(["a", "b", "c"], max_tokens=100, block=True, block_timeout=20)
        t.join()
        assert len(jobs) == 3 and time.monotonic() - t0 >= 0.4
        assert counter(r, keys) == 3 * 101
    r.close()


def test_the_async_client_refuses_naming_the_budget(sdk_url):
    async def main() -> QueueFull:
        async with AsyncClient(sdk_url, max_queued_tokens=100) as c:
            await c.submit("first", max_tokens=90)
            with pytest.raises(QueueFull) as err:
                await c.submit_many(["x", "y"], max_tokens=50, block=False)
            return err.value
    err = asyncio.run(main())
    assert err.reason == "token budget" and err.accepted == []


def test_recount_repairs_a_corrupted_counter_and_leaves_out_jobs_already_ended(sdk_url):
    r = redis.Redis.from_url(sdk_url)
    with Client(sdk_url, max_queued_tokens=10**9) as c:
        keys = c.keys
        c.submit_many([f"job {i}" for i in range(50)], max_tokens=10)
        routed = c.submit("for one worker", max_tokens=10, job_id="routed")
    r.xgroup_create(keys.lane("default"), GROUP, id="0", mkstream=True)
    # one job ran to its end (terminal event written, so released) and waits for its ack
    (_, [(eid, fields)]), = r.xreadgroup(GROUP, "w1", {keys.lane("default"): ">"}, count=1)
    ended = msgpack.unpackb(fields[PAYLOAD_FIELD])["job_id"]
    r.xadd(keys.results(ended), {"data": msgpack.packb({"type": "done", "ts": 1.0,
                                                        "finish_reason": "stop"})})
    # one waits in a registered worker's affinity stream
    r.zadd(keys.workers, {"w9": 1})
    r.xadd(keys.affinity("w9", 0), {PAYLOAD_FIELD: b"x", COST_FIELD: b"77"})
    costs = entry_costs(r, keys)
    want = sum(costs.values()) - costs[ended] + 77
    assert routed.id in costs
    r.set(keys.budget(), 123_456)                        # drift, on purpose
    (row,) = recount_budget(r, keys)
    assert (row["before"], row["now"]) == (123_456, want) and counter(r, keys) == want
    r.set(keys.budget(), -40)
    ns = ["--redis-url", sdk_url, "--namespace", keys.namespace, "--queue", keys.queue]
    assert admin_main(["recount-budget", *ns]) == 0
    assert counter(r, keys) == want
    r.close()


def test_a_counter_overwritten_by_hand_never_blocks_enqueueing(sdk_url):
    r = redis.Redis.from_url(sdk_url)
    with Client(sdk_url, max_queued_tokens=1000) as c:
        r.set(c.keys.budget(), "not a number")
        c.submit("a", max_tokens=9)
        assert counter(r, c.keys) == 10                  # started again from 0
        r.delete(c.keys.budget())
        r.hset(c.keys.budget(), "x", "1")                # even a key of another type
        c.submit("b", max_tokens=9)
        assert counter(r, c.keys) == 10
    r.close()
