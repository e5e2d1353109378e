"""Waiting readers of the asyncio client (producer_sdk/core/hub.py) and what every reader decides by
itself (producer_sdk/core/reads.py): a thousand concurrent ``AsyncClient`` streams on a handful of
connections, a job joining a blocked reader read at once, and a job no worker starts ending
``expired`` on its deadline, cancelled, for both clients."""

from __future__ import annotations

import asyncio
import threading
import time

import msgpack
import pytest
import redis

from tokenrelay.producer_sdk import AsyncClient, Client
from tokenrelay.producer_sdk.errors import JobFailed
from tokenrelay.producer_sdk.jobs.job import AsyncJob
from tokenrelay.protocol.keys import EVENT_FIELD, Keys
from tests.fault_harness import FaultEnv
from tokenrelay.worker.fake_engine import fake_completion

pytestmark = pytest.mark.timeout(120)
JOBS = 1000


def peak_connections(url: str) -> tuple[threading.Event, list[int]]:
    """Sample the server's connected clients until the returned event is set."""
    stop, peak = threading.Event(), [0]
    r = redis.Redis.from_url(url)

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], r.info("clients")["connected_clients"])
            time.sleep(0.05)
        r.close()
    threading.Thread(target=sample, daemon=True).start()
    return stop, peak


def test_a_thousand_async_streams_share_a_few_connections(tmp_path):
    env = FaultEnv(tmp_path, namespace="hub", queue="hq")
    try:
        env.worker("w1", delay=0.01, max_num_seqs=JOBS)
        stop, peak = peak_connections(env.url)

        async def one(client: AsyncClient, i: int) -> str:
            job = await client.submit(f"p{i}", max_tokens=6, temperature=0)
            return "".join([d.text async for d in job.stream(timeout=60)])

        async def main() -> list[str]:
            async with AsyncClient(env.url, queue="hq", namespace="hub",
                                   max_connections=24) as client:
                return await asyncio.gather(*(one(client, i) for i in range(JOBS)))

        try:
            texts = asyncio.run(main())
        finally:
            stop.set()
        assert texts == [fake_completion(f"p{i}", 6) for i in range(JOBS)]
        # the pool's 24 (readers included), the worker's and the sampler's: not a thousand
        assert peak[0] < 40, peak[0]
    finally:
        env.close()


def token(seq: int, text: str) -> bytes:
    return msgpack.packb({"type": "token", "ts": time.time(), "seq": seq, "choice": 0,
                          "position": seq, "text": text, "token_ids": [ord(text)]})


@pytest.mark.parametrize("wake", [True, False])
def test_a_job_joining_a_blocked_reader_is_read_at_once(redis_server, wake):
    """One reader blocks in a 5 s XREAD for job A; job B of the same slot joins; B's first
    token reaches its stream() within a fraction of a second (a wake stream, or 50 ms slices),
    not after the 5 s block."""
    r = redis_server.client()
    keys = Keys("join", "jq")
    for j in ("a", "b"):
        r.xadd(keys.results(j), {EVENT_FIELD: msgpack.packb({"type": "started", "ts": 1.0,
                                                              "worker_id": "w", "attempt": 1})})

    async def main() -> float:
        async with AsyncClient(redis_server.url, queue="jq", namespace="join", poll_ms=5000,
                               reader_wake=wake) as client:
            a, b = AsyncJob(client, "a", keys=keys), AsyncJob(client, "b", keys=keys)
            reading_a = asyncio.create_task(a.result(timeout=30))
            await asyncio.sleep(0.5)                # A's reader is blocked now
            first = asyncio.create_task(anext(b.stream(timeout=30)))
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            r.xadd(keys.results("b"), {EVENT_FIELD: token(0, "x")})
            delta = await first
            took = time.monotonic() - t0
            assert delta.text == "x" and client.hub.readers == 1
            reading_a.cancel()
            return took
    took = asyncio.run(main())
    assert took < 0.5, took
    r.close()


def test_a_job_no_worker_starts_ends_expired_on_its_deadline(redis_server):
    """No worker serves the queue: ``result()`` and ``stream()`` of a job with ``deadline_s``
    end ``expired`` about then (not at the caller's timeout), and the job is cancelled so a
    worker that comes later never runs it."""
    keys = Keys()
    r = redis_server.client()
    with Client(redis_server.url) as c:
        job = c.submit("nobody", deadline_s=0.6)
        t0 = time.monotonic()
        with pytest.raises(JobFailed) as exc:
            job.result(timeout=20)
        assert exc.value.code == "expired" and time.monotonic() - t0 < 2.5
        assert r.exists(keys.cancel(job.id))
        streamed = c.submit("nobody either", deadline_s=0.6)
        with pytest.raises(JobFailed, match="expired"):
            list(streamed.stream(timeout=20))
        assert r.exists(keys.cancel(streamed.id))

    async def main() -> tuple[float, str]:
        async with AsyncClient(redis_server.url) as ac:
            job = await ac.submit("nobody, async", deadline_s=0.6)
            t0 = time.monotonic()
            try:
                async for _ in job.stream(timeout=20):
                    pass
            except JobFailed as failed:
                return time.monotonic() - t0, failed.code
            raise AssertionError("no JobFailed")
    took, code = asyncio.run(main())
    assert code == "expired" and took < 2.5, took
    r.close()


def test_a_rerun_carries_the_seed_of_the_tokens_the_reader_holds():
    """A lost job put back in its queue must make the tokens its reader already has: its
    request gets the seed of the run that made the reader's first token (not a later run's,
    whose repeats the fold skipped), unless it named one itself; beam search takes none."""
    from tokenrelay.producer_sdk.jobs.job import JobState
    from tokenrelay.producer_sdk.jobs.payloads import PayloadBuilder
    from tokenrelay.producer_sdk.core.reads import rerun_request
    from tokenrelay.protocol.wire import decode_job
    builder = PayloadBuilder(Keys())
    state = JobState("j", "k")
    state.feed([(b"1-0", {EVENT_FIELD: msgpack.packb({"type": "started", "ts": 1.0,
                                                       "attempt": 1, "seed": 11})}),
                (b"2-0", {EVENT_FIELD: token(0, "a")}),
                (b"3-0", {EVENT_FIELD: msgpack.packb({"type": "started", "ts": 2.0,
                                                       "attempt": 2, "seed": 99})})])
    assert (state.token_seed, state.seed) == (11, 99)
    sampled = builder.build("p", job_id="j", temperature=1.0)
    assert decode_job(rerun_request(sampled, state.token_seed).payload).params["seed"] == 11
    own = builder.build("p", job_id="j", temperature=1.0, seed=5)
    assert rerun_request(own, 11) is own
    beams = builder.build("p", job_id="j", beam_width=2)
    assert rerun_request(beams, 11) is beams
