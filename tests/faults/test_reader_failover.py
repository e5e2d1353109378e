"""Readers through a Redis Cluster failover (issue #25): result reads, status reads and cancels
retry CLUSTERDOWN, TRYAGAIN and MOVED for a bounded time (``reconnect_timeout_s`` /
``--redis-retry-s``) as they retry a lost connection, in the sync and async SDK and the
gateway; only past it does a caller see an error. A 3-master, 3-replica cluster of its own
(tests/faults/test_cluster_failover.py kills masters of its cluster)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tokenrelay.protocol.keys import key_slot
from tests.fault_harness import FaultEnv, wait_for
from tokenrelay.worker.fake_engine import fake_completion
from devtools.redis_server import RedisCluster

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster():
    c = RedisCluster(masters=3, replicas=1).start(timeout=60)
    yield c
    c.stop()


def test_readers_ride_out_a_failover(cluster, tmp_path, request):
    """30 live ``stream()`` readers (15 sync, 15 async) of jobs on the three shards of a queue,
    4 gateway SSE streams, and status reads and cancels in a loop, while the master of one
    shard is SIGKILLed: CLUSTERDOWN, TRYAGAIN and MOVED are retried like a lost connection,
    so none of them raises, and every stream ends with its whole completion, each token once."""
    import asyncio
    import threading

    import httpx

    from tokenrelay.producer_sdk import AsyncClient
    from tests.gateway.helpers import GatewayProcess, sse_events

    env = FaultEnv(tmp_path, namespace="rf", shards=3, cluster=cluster)
    request.addfinalizer(env.close)
    shard = next(s for s in range(3)
                 if cluster.replicas_of(cluster.master_of_slot(key_slot(env.keys.lane("default", s)))))
    slot = key_slot(env.keys.lane("default", shard))
    victim = cluster.master_of_slot(slot)
    env.worker("w1", delay=0.04, max_num_seqs=64)
    gw = GatewayProcess(tmp_path / "gateway.log", "--redis-url", cluster.url, "--namespace",
                        "rf", "--shards", "3", "--status-wait-s", "0.2").wait_up()
    request.addfinalizer(gw.stop)
    tokens = 100
    client = env.client(shards=3, cluster=True)
    sync_jobs = [client.submit(f"sync {i}", max_tokens=tokens, temperature=0) for i in range(15)]
    texts: dict[str, str] = {}
    errors: list[str] = []
    started = threading.Event()
    killed = threading.Event()
    live: list[str] = []        # readers whose job was submitted (and, for SSE, streaming)

    def guard(name: str, fn: Any) -> threading.Thread:
        def run() -> None:
            try:
                texts[name] = fn()
            except BaseException as exc:
                import traceback
                errors.append(f"{name}: {''.join(traceback.format_exception(exc))[-1500:]}")
        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def sync_read(job: Any) -> str:
        return "".join(d.text for d in job.stream(timeout=120))

    async def async_all() -> list[str]:
        async with AsyncClient(env.url, queue=env.keys.queue, namespace="rf", shards=3,
                               cluster=True) as ac:
            jobs = [await ac.submit(f"async {i}", max_tokens=tokens, temperature=0)
                    for i in range(15)]
            live.append("async")

            async def one(job: Any) -> str:
                return "".join([d.text async for d in job.stream(timeout=120)])
            return await asyncio.gather(*(one(j) for j in jobs))

    def gateway_read(i: int) -> str:
        out = []
        with httpx.stream("POST", f"{gw.v1}/completions", timeout=120, json={
                "model": "fake", "prompt": f"gw {i}", "max_tokens": tokens,
                "temperature": 0, "stream": True}) as resp:
            assert resp.status_code == 200, resp.read()
            for kind, obj in sse_events(resp.iter_lines()):
                if kind == "data":
                    assert "error" not in obj, obj
                    out.append(obj["choices"][0]["text"] if obj["choices"] else "")
                    if len(out) == 1:
                        live.append(f"gw {i}")
        return "".join(out)

    cancelled = client.submit("to cancel", max_tokens=3000)

    def poll_status() -> str:          # through the failover and 3 s past it
        started.wait(60)
        end = None
        while end is None or time.monotonic() < end:
            client.statuses([j.id for j in sync_jobs])
            client.cancel(cancelled.id)
            time.sleep(0.1)
            if end is None and killed.is_set():
                end = time.monotonic() + 3
        return "polled"

    threads = [guard(f"sync {i}", lambda j=j: sync_read(j)) for i, j in enumerate(sync_jobs)]
    threads.append(guard("async", lambda: "|".join(asyncio.run(async_all()))))
    threads += [guard(f"gw {i}", lambda i=i: gateway_read(i)) for i in range(4)]
    threads.append(guard("status", poll_status))
    # Submits are not the readers' promise (a submit while a shard has no master is 503 /
    # RedisUnavailable): every reader has its job and its tokens flowing before the kill.
    wait_for(lambda: len(live) == 5 or bool(errors), 60, what="every reader live")
    wait_for(lambda: env.tokens_streamed([j.id for j in sync_jobs]) >= 15 * 10, 60,
             what="tokens flowing")
    started.set()
    cluster.kill(victim)
    wait_for(lambda: cluster.master_of_slot(slot) != victim, 30, interval=0.1,
             what="the replica took over")
    killed.set()
    for t in threads:
        t.join(150)
    assert not errors, "\n".join(errors[:3])
    for i in range(15):
        assert texts[f"sync {i}"] == fake_completion(f"sync {i}", tokens), i
    assert texts["async"].split("|") == [fake_completion(f"async {i}", tokens)
                                         for i in range(15)]
    for i in range(4):
        assert texts[f"gw {i}"] == fake_completion(f"gw {i}", tokens), i
