"""A gateway's cancels never wait for a connection of the shared pool (issue #42): while the
streams of thousands of clients open, their submits and reads can hold every pooled
connection, and a cancel queued behind them waited 3.6-9.8 s in the gateway load benchmark.
Here the shared pool is exhausted by hand and a cancel must still land at once. Nor do they
wait for turns of the event loop, which took up to half a second each at 2,000 streams: a
cancel must land while the loop never yields."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from tokenrelay.producer_sdk.gateway.backend import Gateway
from tokenrelay.producer_sdk.gateway.metrics import GatewayMetrics
from tokenrelay.producer_sdk.gateway.settings import GatewaySettings

pytestmark = pytest.mark.timeout(60)
POOL = 4


async def cancel_with_the_pool_taken(url: str) -> float:
    """Seconds until a cancel's flag is in Redis while every shared connection is held."""
    gw = Gateway(GatewaySettings(redis_url=url, redis_max_connections=POOL,
                                 redis_pool_timeout_s=3.0), None, GatewayMetrics())
    await gw.ready()
    job = await gw.client("default").submit("nobody serves this", max_tokens=1)
    pool = gw.redis.connection_pool
    held = [await pool.get_connection() for _ in range(POOL)]
    check = redis.Redis.from_url(url)
    try:
        t0 = time.monotonic()
        gw.cancels.add(job.cancel_target)
        while not check.exists(job.cancel_target.flag):
            assert time.monotonic() - t0 < 10, "the cancel never landed"
            await asyncio.sleep(0.01)
        return time.monotonic() - t0
    finally:
        check.close()
        for conn in held:
            await pool.release(conn)
        await gw.close()


def test_a_cancel_lands_while_the_shared_pool_is_exhausted(redis_server):
    assert asyncio.run(cancel_with_the_pool_taken(redis_server.url)) < 1.0


async def cancel_with_the_loop_blocked(url: str) -> bool:
    """Whether a cancel's flag reaches Redis while the event loop is held by a synchronous
    wait that never yields (a saturated loop, at its worst)."""
    gw = Gateway(GatewaySettings(redis_url=url), None, GatewayMetrics())
    await gw.ready()
    job = await gw.client("default").submit("nobody serves this", max_tokens=1)
    check = redis.Redis.from_url(url)
    try:
        gw.cancels.add(job.cancel_target)
        ends = time.monotonic() + 10
        while time.monotonic() < ends:          # no await: the loop is blocked here
            if check.exists(job.cancel_target.flag):
                return True
            time.sleep(0.01)
        return False
    finally:
        check.close()
        await gw.close()


def test_a_cancel_lands_while_the_event_loop_is_blocked(redis_server):
    assert asyncio.run(cancel_with_the_loop_blocked(redis_server.url)), \
        "the cancel waited for the event loop"
