"""The client core (producer_sdk/core/client_core.py) is the one home of what both clients do: each
scenario here is written once and runs on ``Client`` and on ``AsyncClient`` (through
``Driven``, which waits for the async one), against a private redis-server and the fake worker.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Iterable, Optional

import msgpack
import pytest
import redis

from tokenrelay.producer_sdk import (AsyncClient, Client, ClientClosed, JobFailed, JobNotFound, QueueFull,
                          RedisUnavailable)
from tokenrelay.protocol.keys import EVENT_FIELD, Keys
from tests.sdk_helpers import FakeWorker, free_port, sdk_redis, sdk_url  # noqa: F401

KEYS = Keys()


class Driven:
    """A Client, or an AsyncClient driven on its own event loop, behind one blocking face."""

    def __init__(self, kind: str, url: str, **settings: Any) -> None:
        self.loop = asyncio.new_event_loop() if kind == "async" else None
        self.client = (AsyncClient if self.loop else Client)(url, **settings)

    def wait(self, value: Any) -> Any:
        if inspect.isawaitable(value):
            return self.loop.run_until_complete(asyncio.wait_for(value, 60))
        return value

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.client, name)
        return lambda *args, **kwargs: self.wait(method(*args, **kwargs))

    def result(self, job: Any, timeout: Optional[float] = None) -> Any:
        return self.wait(job.result(timeout))

    def texts(self, job: Any, timeout: float = 10, cancel_after: Optional[int] = None) -> list:
        """The deltas' texts; with ``cancel_after``, cancels the job once that many came."""
        if self.loop is None:
            out = []
            for d in job.stream(timeout):
                out.append(d.text)
                if len(out) == cancel_after:
                    job.cancel()
                    break
            return out

        async def collect() -> list:
            out = []
            async for d in job.stream(timeout):
                out.append(d.text)
                if len(out) == cancel_after:
                    await job.cancel()
                    break
            return out
        return self.wait(collect())

    def completed(self, source: Iterable[Any], n: int, **kwargs: Any) -> list:
        """The first ``n`` pairs ``iter_completed`` yields; then the reader stops (its cleanup
        runs)."""
        if self.loop is None:
            it = self.client.iter_completed(source, **kwargs)
            got = [next(it) for _ in range(n)]
            it.close()
            return got

        async def first() -> list:
            it = self.client.iter_completed(source, **kwargs)
            got = [await it.__anext__() for _ in range(n)]
            await it.aclose()
            return got
        return self.wait(first())

    def dispose(self) -> None:
        self.wait(self.client.close())      # closing twice is fine
        if self.loop is not None:
            self.loop.close()


@pytest.fixture(params=["sync", "async"])
def driven(request, sdk_url):
    """``driven(**settings)``: a client of the parametrized kind on the test's Redis."""
    made: list[Driven] = []

    def make(url: str = sdk_url, **settings: Any) -> Driven:
        made.append(Driven(request.param, url, **settings))
        return made[-1]
    yield make
    for d in made:
        d.dispose()


def test_submit_stream_result_cancel_failure_and_resume(driven, sdk_url):
    c = driven()
    with FakeWorker(sdk_url):
        job = c.submit("hello", max_tokens=3)
        assert c.texts(job) == [" t0", " t1", " t2"]
        res = c.result(job)
        assert res.text == " t0 t1 t2" and res.finish_reason == "length"
        slow = c.submit("SLOW", max_tokens=200)
        assert len(c.texts(slow, cancel_after=1)) == 1
        assert c.result(slow, timeout=10).finish_reason == "cancelled"
        with pytest.raises(JobFailed) as err:
            c.result(c.submit("FAIL"), timeout=10)
        assert err.value.code == "internal"
        crash = c.submit("CRASH", max_tokens=5)
        assert "".join(c.texts(crash)) == " t0 t1 t2 t3 t4"


def test_reattach_idempotent_submit_timeout_and_unknown_ids(driven, sdk_url):
    c = driven()
    a = c.submit("x", job_id="a1", max_tokens=2)
    b = c.submit("x", job_id="a1", max_tokens=2)
    assert b.reattached and not a.reattached
    with pytest.raises(TimeoutError):
        c.result(a, timeout=0.2)
    with pytest.raises(JobNotFound):
        c.get("missing")
    assert [s.state for s in c.statuses(["a1", "missing"])] == ["queued", "unknown"]
    r = redis.Redis.from_url(sdk_url)
    assert r.xlen(KEYS.lane("default")) == 1
    r.close()
    with FakeWorker(sdk_url):
        assert c.result(c.get("a1"), timeout=10).text == " t0 t1"


def test_backpressure_bulk_submit_and_map(driven, sdk_url):
    c = driven(max_queued_jobs=3)
    c.submit_many(["a", "b", "c"], max_tokens=1)
    with pytest.raises(QueueFull):
        c.submit("d")
    assert c.queue_depth() == 3
    worker = FakeWorker(sdk_url, start_delay=0.2)
    worker.start()
    try:
        t0 = time.monotonic()
        jobs = c.submit_many([f"p{i}" for i in range(8)], max_tokens=1)
        assert time.monotonic() - t0 > 0.1
        assert [c.result(j, timeout=10).text for j in jobs] == [" t0"] * 8
        out = c.map([f"m{i}" for i in range(20)] + ["FAIL"], concurrency=3, progress=False,
                    return_exceptions=True, max_tokens=2)
        assert [r.text for r in out[:20]] == [" t0 t1"] * 20
        assert isinstance(out[20], JobFailed)
    finally:
        worker.stop()
    assert worker.max_depth_seen <= 3


def test_a_window_left_early_cancels_what_is_in_flight(driven, sdk_url):
    c = driven()
    r = redis.Redis.from_url(sdk_url)
    r.xadd(KEYS.results("w0"), {EVENT_FIELD: msgpack.packb(
        {"type": "done", "finish_reason": "stop", "text": "early"}, use_bin_type=True)})
    source = [(i, c.prepare("x", job_id=f"w{i}", max_tokens=1)) for i in range(4)]
    source.append((4, c.prepare("x", job_id="w1", max_tokens=1)))     # w1 again: a duplicate
    submitted: list = []
    (dup_tag, dup), (tag, job) = c.completed(iter(source), 2, concurrency=5,
                                             on_submitted=submitted.extend)
    assert len(submitted) == 5 and dup_tag == 4      # the duplicate fails at once
    with pytest.raises(JobFailed, match="already in flight"):
        dup.state.result()
    assert (tag, job.state.result().text) == (0, "early")
    assert [r.exists(KEYS.cancel(f"w{i}")) for i in range(4)] == [0, 1, 1, 1]
    r.close()


def test_unreachable_redis_fails_fast_and_a_closed_client_never_reconnects(driven):
    c = driven(f"redis://127.0.0.1:{free_port()}/0")
    t0 = time.monotonic()
    with pytest.raises(RedisUnavailable):
        c.submit("x")
    assert time.monotonic() - t0 < 5
    c.close()
    with pytest.raises(ClientClosed):
        c.submit("x")
