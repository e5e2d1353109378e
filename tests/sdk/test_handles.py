"""Job handles shared between readers, finished jobs read without waiting, and closed clients."""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis

from tokenrelay.producer_sdk import AsyncClient, Client
from tokenrelay.producer_sdk.errors import ClientClosed
from tokenrelay.protocol.keys import EVENT_FIELD, Keys
from tests.fault_harness import wait_for
from tests.sdk_helpers import FakeWorker, sdk_redis, sdk_url  # noqa: F401

KEYS = Keys()


def _finished(url: str, job_id: str) -> bool:
    r = redis.Redis.from_url(url)
    try:
        last = r.xrevrange(KEYS.results(job_id), count=1)
        return bool(last) and b"done" in last[0][1][EVENT_FIELD]
    finally:
        r.close()


@pytest.mark.timeout(60)
def test_one_job_read_from_three_threads_gives_every_reader_every_delta(sdk_url: str):
    """stream() in two threads and result() in a third: each stream sees all deltas, in order,
    exactly once (before, the readers split the deltas between them)."""
    with Client(sdk_url) as client, FakeWorker(sdk_url, token_delay=0.003, start_delay=0.3):
        job = client.submit("hello", max_tokens=60)
        streams: list[list] = [[], []]
        results: list = []
        started = threading.Barrier(3)

        def read_stream(out: list) -> None:
            started.wait()
            out.extend(job.stream(timeout=30))

        def read_result() -> None:
            started.wait()
            results.append(job.result(timeout=30))

        threads = [threading.Thread(target=read_stream, args=(streams[0],)),
                   threading.Thread(target=read_stream, args=(streams[1],)),
                   threading.Thread(target=read_result)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=40)
        want = "".join(f" t{i}" for i in range(60))
        assert results and results[0].text == want
        for got in streams:
            assert [d.seq for d in got] == list(range(60))
            assert "".join(d.text for d in got) == want


@pytest.mark.timeout(60)
def test_result_with_timeout_zero_returns_a_finished_job(sdk_url: str):
    """The result stream already holds the terminal event (more entries than one XREAD reads):
    result(timeout=0) on a fresh handle reads Redis and returns, no TimeoutError."""
    with Client(sdk_url) as client:
        with FakeWorker(sdk_url):
            job = client.submit("long", max_tokens=700)
            wait_for(lambda: _finished(sdk_url, job.id), timeout=30)
        fresh = client.get(job.id)
        res = fresh.result(timeout=0)
        assert len(res.token_ids) == 700 and res.finish_reason == "length"
        again = client.get(job.id)
        assert len(list(again.stream(timeout=0))) == 700


@pytest.mark.timeout(60)
def test_result_with_timeout_zero_still_times_out_while_running(sdk_url: str):
    with Client(sdk_url) as client:
        job = client.submit("nobody runs me", max_tokens=3)
        with pytest.raises(TimeoutError):
            job.result(timeout=0)


@pytest.mark.timeout(60)
def test_closed_client_raises_instead_of_reconnecting(sdk_url: str):
    client = Client(sdk_url)
    job = client.submit("x", max_tokens=2)
    client.close()
    for use in (lambda: client.submit("y"), lambda: client.submit_many(["a"]),
                lambda: job.result(timeout=1), lambda: client.get(job.id),
                lambda: client.cancel(job.id), client.queue_depth, client.ping):
        with pytest.raises(ClientClosed, match="closed"):
            use()
    client.close()  # closing twice is fine
    r = redis.Redis.from_url(sdk_url)
    assert sum(r.xlen(k) for k in KEYS.lanes()) == 1  # nothing was sent after close
    r.close()


@pytest.mark.timeout(60)
def test_closed_async_client_raises(sdk_url: str):
    async def main() -> None:
        client = AsyncClient(sdk_url)
        job = await client.submit("x", max_tokens=2)
        await client.close()
        with pytest.raises(ClientClosed):
            await client.submit("y")
        with pytest.raises(ClientClosed):
            await job.result(timeout=1)
        with pytest.raises(ClientClosed):
            await client.queue_depth()
        await client.close()

    asyncio.run(asyncio.wait_for(main(), timeout=30))


@pytest.mark.timeout(60)
def test_async_result_timeout_zero_and_two_streams(sdk_url: str):
    async def main() -> None:
        async with AsyncClient(sdk_url) as client:
            job = await client.submit("hi", max_tokens=20)

            async def collect() -> list:
                return [d async for d in job.stream(timeout=20)]

            a, b, res = await asyncio.gather(collect(), collect(), job.result(timeout=20))
            assert [d.seq for d in a] == [d.seq for d in b] == list(range(20))
            again = await client.get(job.id)
            assert (await again.result(timeout=0)).text == res.text

    with FakeWorker(sdk_url, token_delay=0.002, start_delay=0.2):
        asyncio.run(asyncio.wait_for(main(), timeout=40))


@pytest.mark.timeout(60)
def test_stream_with_timeout_zero_yields_what_is_there_then_times_out(sdk_url: str):
    r = redis.Redis.from_url(sdk_url)
    with Client(sdk_url) as client, FakeWorker(sdk_url):
        job = client.submit("SLOW", max_tokens=400)
        wait_for(lambda: r.xlen(KEYS.results(job.id)) >= 4, timeout=20)  # started + 3 tokens
        got = []
        with pytest.raises(TimeoutError):
            for delta in client.get(job.id).stream(timeout=0):
                got.append(delta)
        assert len(got) >= 3 and [d.seq for d in got] == list(range(len(got)))
        job.cancel()
    r.close()
