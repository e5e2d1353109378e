"""Producer SDK (AsyncClient) against a private redis-server and the fake worker."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from producer_sdk import AsyncClient, JobFailed, JobNotFound, QueueFull, RedisUnavailable
from protocol.keys import Keys
from tests.sdk_helpers import FakeWorker, free_port, sdk_redis, sdk_url  # noqa: F401

KEYS = Keys()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def test_async_submit_stream_result_cancel(sdk_url: str):
    async def main():
        async with AsyncClient(sdk_url) as c:
            job = await c.submit("hello", max_tokens=3)
            texts = [d.text async for d in job.stream(timeout=10)]
            assert texts == [" t0", " t1", " t2"]
            res = await job.result()
            assert res.text == " t0 t1 t2" and res.finish_reason == "length"
            slow = await c.submit("SLOW", max_tokens=200)
            async for _ in slow.stream(timeout=10):
                await slow.cancel()
                break
            assert (await slow.result(timeout=10)).finish_reason == "cancelled"
            with pytest.raises(JobFailed) as err:
                await (await c.submit("FAIL")).result(timeout=10)
            assert err.value.code == "internal"
            crash = await c.submit("CRASH", max_tokens=5)
            assert "".join([d.text async for d in crash.stream(timeout=10)]) == \
                " t0 t1 t2 t3 t4"

    with FakeWorker(sdk_url):
        run(main())


def test_async_reattach_idempotent_timeout(sdk_url: str):
    async def main():
        async with AsyncClient(sdk_url) as c:
            a = await c.submit("x", job_id="a1", max_tokens=2)
            b = await c.submit("x", job_id="a1", max_tokens=2)
            assert b.reattached and not a.reattached
            with pytest.raises(TimeoutError):
                await a.result(timeout=0.2)
            with pytest.raises(JobNotFound):
                await c.get("missing")
            return await c.get("a1")

    job_handle = run(main())
    assert job_handle.id == "a1"
    r = redis.Redis.from_url(sdk_url)
    assert r.xlen(KEYS.lane("default")) == 1
    r.close()

    async def finish():
        async with AsyncClient(sdk_url) as c:
            return await (await c.get("a1")).result(timeout=10)

    with FakeWorker(sdk_url):
        assert run(finish()).text == " t0 t1"


def test_async_backpressure_bulk_and_map(sdk_url: str):
    async def main():
        async with AsyncClient(sdk_url, max_queued_jobs=3) as c:
            await c.submit_many(["a", "b", "c"], max_tokens=1)
            with pytest.raises(QueueFull):
                await c.submit("d")
            assert await c.queue_depth() == 3
            worker = FakeWorker(sdk_url, start_delay=0.2)
            worker.start()
            try:
                t0 = time.monotonic()
                jobs = await c.submit_many([f"p{i}" for i in range(8)], max_tokens=1)
                assert time.monotonic() - t0 > 0.1
                assert [(await j.result(timeout=10)).text for j in jobs] == [" t0"] * 8
                out = await c.map([f"m{i}" for i in range(20)] + ["FAIL"], concurrency=3,
                                  progress=False, return_exceptions=True, max_tokens=2)
                assert [r.text for r in out[:20]] == [" t0 t1"] * 20
                assert isinstance(out[20], JobFailed)
            finally:
                worker.stop()
            assert worker.max_depth_seen <= 3

    run(main())


def test_async_unreachable_fails_fast():
    async def main():
        async with AsyncClient(f"redis://127.0.0.1:{free_port()}/0") as c:
            t0 = time.monotonic()
            with pytest.raises(ConnectionError) as err:
                await c.submit("x")
            assert isinstance(err.value, RedisUnavailable)
            assert time.monotonic() - t0 < 5

    run(main())
