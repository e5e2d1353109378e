"""Logprobs with token text through a real worker loop (FakeEngine: token id = ord(char)):
``Delta.token_logprobs``, ``CompletionOutput.token_logprobs`` and ``Result.token_logprobs``,
streamed and not, one choice and several, sync and async; a job without logprobs carries none."""

from __future__ import annotations

import asyncio

import pytest

from tokenrelay.producer_sdk import AsyncClient, Client


def check(token_logprobs, token_ids, top: int) -> None:
    assert [t.token_id for t in token_logprobs] == token_ids
    for t in token_logprobs:
        assert (t.token, t.bytes, t.logprob) == (chr(t.token_id), [t.token_id], -0.5)
        assert len(t.top_logprobs) == max(1, top)
        assert t.top_logprobs[0].token_id == t.token_id
        assert [a.logprob for a in t.top_logprobs] == sorted(
            (a.logprob for a in t.top_logprobs), reverse=True)
        assert all(a.token == chr(a.token_id) and a.bytes == [a.token_id]
                   for a in t.top_logprobs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [True, False])
def test_sync_token_logprobs(redis_server, start_worker, stream):
    start_worker()
    with Client(redis_server.url) as client:
        job = client.submit("hello", max_tokens=5, temperature=0, logprobs=3, stream=stream)
        deltas = list(job.stream(timeout=30))
        res = job.result(timeout=30)
        check(res.token_logprobs, res.token_ids, 3)
        assert [t for d in deltas for t in d.token_logprobs] == res.token_logprobs
        assert res.outputs[0].token_logprobs == res.token_logprobs
        several = client.submit("hi", max_tokens=4, temperature=1.0, seed=1, n=2, logprobs=0,
                                stream=stream).result(timeout=30)
        assert len(several.outputs) == 2
        for out in several.outputs:
            check(out.token_logprobs, out.token_ids, 0)
        plain = client.submit("hello", max_tokens=3, stream=stream).result(timeout=30)
        assert plain.token_logprobs is None and plain.logprobs is None


@pytest.mark.timeout(60)
def test_async_token_logprobs(redis_server, start_worker):
    start_worker()

    async def run():
        async with AsyncClient(redis_server.url) as client:
            job = await client.submit("hello", max_tokens=4, temperature=0, logprobs=2)
            deltas = [d async for d in job.stream(timeout=30)]
            return deltas, await job.result(timeout=30)
    deltas, res = asyncio.run(run())
    check(res.token_logprobs, res.token_ids, 2)
    assert [t for d in deltas for t in d.token_logprobs] == res.token_logprobs
