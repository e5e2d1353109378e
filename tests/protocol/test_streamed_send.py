"""``topology.send_packed_trailed`` with items packed on demand (the bulk enqueue's streamed
send), against a real redis-server: every item packed once, the replies those of the same
items sent in one write, in order, the trailer's reply after them, sync and asyncio."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio

from tokenrelay.protocol.scripts import pack
from tokenrelay.protocol.topology import (STREAM_AHEAD, async_send_packed_trailed, send_packed_trailed)

pytestmark = pytest.mark.timeout(30)
N = 3 * STREAM_AHEAD + 5


def items(calls: list[int]) -> list:
    """Items of two commands each; each packs itself when asked and notes that it was."""
    def packer(i: int):
        def packed() -> bytes:
            calls.append(i)
            return pack([b"INCR", b"counter"]) + pack([b"ECHO", b"item %d" % i])
        return packed
    return [("counter", packer(i), 2) for i in range(N)]


def test_a_streamed_batch_answers_as_one_write_does(redis_server):
    r = redis_server.client()
    calls: list[int] = []
    replies, trailed = send_packed_trailed(r, items(calls), pack([b"PING"]))
    assert calls == list(range(N))                          # each packed once, in order
    assert replies == [x for i in range(N) for x in (i + 1, b"item %d" % i)]
    assert trailed == [b"PONG"] * N
    flat, _ = send_packed_trailed(r, [(k, data(), n) for k, data, n in items([])], None)
    assert flat == [x for i in range(N) for x in (N + i + 1, b"item %d" % i)]
    r.close()


def test_the_asyncio_send_streams_the_same_way(redis_server):
    async def main() -> tuple:
        r = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            return await async_send_packed_trailed(r, items(calls), pack([b"PING"]))
        finally:
            await r.aclose()
    calls: list[int] = []
    replies, trailed = asyncio.run(main())
    assert calls == list(range(N))
    assert replies == [x for i in range(N) for x in (i + 1, b"item %d" % i)]
    assert trailed == [b"PONG"] * N
