"""Cancel binds to a job that exists (issue #25): cancel of an id Redis holds no record of is
reported (``JobNotFound``) and writes nothing, so a later job submitted under that id runs
normally; a flag set for a real job expires with the job's records. On a real redis-server with
an in-process worker (FakeEngine)."""

from __future__ import annotations

import asyncio

import pytest

from tokenrelay.producer_sdk import AsyncClient, Client
from tokenrelay.producer_sdk.errors import JobNotFound
from tokenrelay.protocol.keys import Keys
from tokenrelay.protocol.scripts import CANCEL_KNOWN, cancel_target

pytestmark = pytest.mark.timeout(60)


def test_cancel_of_an_unknown_id_is_reported_and_a_later_job_of_that_id_runs(
        redis_server, start_worker):
    r = redis_server.client()
    with Client(redis_server.url) as client:
        with pytest.raises(JobNotFound, match="ghost"):
            client.cancel("ghost")

        async def async_cancel() -> None:
            async with AsyncClient(redis_server.url) as ac:
                await ac.cancel("ghost-2")
        with pytest.raises(JobNotFound):
            asyncio.run(async_cancel())
        assert r.keys("*cancel*") == []
        start_worker()
        for job_id in ("ghost", "ghost-2"):
            result = client.submit("hello", job_id=job_id, max_tokens=4).result(timeout=30)
            assert (result.finish_reason, result.usage.completion_tokens) == ("length", 4)
    r.close()


def test_a_flag_expires_with_the_jobs_records(redis_server):
    r = redis_server.client()
    with Client(redis_server.url, dedupe_ttl_s=50) as client:
        job = client.submit("queued", max_tokens=2)
        r.script_flush()                    # NOSCRIPT: loaded and sent again
        client.cancel(job.id)
        flag = Keys().cancel(job.id)
        assert r.get(flag) == b"1"
        assert 0 < r.pttl(flag) <= r.pttl(Keys().dedupe(job.id)) + 50 <= 50_050
        assert client.status(job.id).cancel_requested
    # a record without a TTL keeps the TTL asked for; no record at all: nothing written
    target = cancel_target(Keys(), "raw")
    r.xadd(target.results, {"data": b"x"})
    assert r.eval(CANCEL_KNOWN.source, 4, *target, 600) == 1
    assert 590_000 < r.pttl(target.flag) <= 600_000
    missing = cancel_target(Keys(), "absent")
    assert r.eval(CANCEL_KNOWN.source, 4, *missing, 600) == 0 and not r.exists(missing.flag)
    r.close()
