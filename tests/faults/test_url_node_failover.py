"""A cluster client keeps reading streams when the node its URL names dies (issue #42).

redis-py asks one node, the one its commands parser was made with (the URL's), for XREAD's keys
(``COMMAND GETKEYS``); with that node dead every XREAD failed until the caller's retry bound ran
out, on every shard. ``protocol/slot_routing.py`` computes a stream read's slot itself: reads of
keys on live masters go on at once, and keys of the dead master's slots come back after the
failover. The gateway-level trials (16 SSE streams, the URL's node killed again and again) are
``python -m benchmarks.failover``; tests/faults/test_reader_failover.py covers the readers."""

from __future__ import annotations

import asyncio
import time

import pytest

from tokenrelay.protocol.keys import key_slot
from tokenrelay.protocol.slot_routing import local_slot, stream_read_keys
from tokenrelay.protocol.topology import make_async_client, make_client
from devtools.redis_server import RedisCluster

pytestmark = pytest.mark.timeout(180)


def test_a_stream_reads_slot_is_computed_from_its_keys():
    assert stream_read_keys(["COUNT", 5, "BLOCK", 10, "STREAMS", "a{t}", "b{t}", "0", "$"]) == ["a{t}", "b{t}"]
    assert local_slot("xreadgroup", ["GROUP", "g", "c", "STREAMS", b"r{t}", ">"]) == key_slot("t")
    assert local_slot("GET", ["k"]) is None
    from redis.exceptions import RedisClusterException
    with pytest.raises(RedisClusterException, match="CROSSSLOT"):
        local_slot("XREAD", ["STREAMS", "a{x}", "b{y}", "0", "0"])
    with pytest.raises(RedisClusterException, match="ids"):
        local_slot("XREAD", ["STREAMS", "a{x}", "b{x}", "0"])


def _key_on(cluster: RedisCluster, node: int, prefix: str) -> str:
    return next(k for k in (f"{prefix}{{t{i}}}" for i in range(10_000))
                if cluster.master_of_slot(key_slot(k)) == node)


@pytest.fixture(scope="module")
def cluster():
    c = RedisCluster(masters=3, replicas=1).start(timeout=60)
    yield c
    c.stop()


def test_reads_go_on_when_the_urls_node_dies(cluster):
    """The URL names node 0 (a master). It is SIGKILLed: reads of a stream on another master
    answer at once (sync and asyncio clients, without a reconnect bound to wait out), and a
    stream on node 0's own slots answers again once its replica took over."""
    asyncio.run(_reads_through_the_kill(cluster))


async def _reads_through_the_kill(cluster: RedisCluster) -> None:
    live_key, dead_key = _key_on(cluster, 1, "live"), _key_on(cluster, 0, "dead")
    sync = make_client(cluster.url, cluster=True, socket_timeout=2, socket_connect_timeout=1)
    aio = make_async_client(cluster.url, cluster=True, socket_timeout=2, socket_connect_timeout=1)
    try:
        for key in (live_key, dead_key):
            sync.xadd(key, {"n": 1})
        assert sync.xread({live_key: "0"}, count=5)
        assert await aio.xread({live_key: "0"}, count=5)
        cluster.kill(0)
        t0 = time.monotonic()
        assert sync.xread({live_key: "0"}, count=5)
        assert await aio.xread({live_key: "0"}, count=5)
        assert _piped_read(sync, live_key) and await _piped_read_async(aio, live_key)
        assert time.monotonic() - t0 < 5.0, "a read of a live master's stream waited on the dead node"
        deadline = time.monotonic() + 30
        while True:                          # the dead master's slots: back after the failover
            try:
                if sync.xread({dead_key: "0"}, count=5) and await aio.xread({dead_key: "0"}, count=5):
                    break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
    finally:
        sync.close()
        await aio.aclose()


def _piped_read(client, key: str) -> list:
    """An XREAD through a sync pipeline (redis-py builds those apart from the client)."""
    pipe = client.pipeline(transaction=False)
    pipe.xread({key: "0"}, count=5)
    return pipe.execute()[0]


async def _piped_read_async(client, key: str) -> list:
    pipe = client.pipeline(transaction=False)
    pipe.xread({key: "0"}, count=5)
    return (await pipe.execute())[0]
