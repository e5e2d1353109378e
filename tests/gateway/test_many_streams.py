"""Many clients, few connections: 300 streamed requests that leave after a few chunks and 40
ordinary requests beside them, through one ``tokenrelay gateway`` process (a pool
of 16 Redis connections, readers of 64 streams) and a ``--model fake:`` worker process. No
5xx, every ordinary answer right, every abandoned job cancelled within a few engine steps, and
the gateway's Redis connections stay a handful (shared readers, a bounded waiting pool)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import redis

from tokenrelay.protocol.keys import Keys
from tests.fault_harness import read_events, wait_for
from tests.gateway.helpers import sse_events, worker_and_gateway
from tokenrelay.worker.fake_engine import fake_completion

pytestmark = pytest.mark.timeout(180)
STREAMS, ORDINARY, MAX_TOKENS = 300, 40, 2000


@pytest.fixture
def env(tmp_path):
    with worker_and_gateway(tmp_path, "many", "mq", "--redis-max-connections", "16",
                            "--reader-streams", "64", "--status-wait-s", "0.2",
                            "--resume-grace-s", "0",
                            max_num_seqs=512) as pair:
        yield pair


async def abandon(client: httpx.AsyncClient, url: str, i: int) -> tuple[int, str, int]:
    """Stream a long job, leave after 3 chunks: (status, job id, chunks read)."""
    body = {"model": "fake", "prompt": f"leave {i}", "max_tokens": MAX_TOKENS, "stream": True}
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            return resp.status_code, "", 0
        got = 0
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                got += 1
                if got == 3:
                    break
        return 200, resp.headers["x-job-id"], got


async def ordinary(client: httpx.AsyncClient, url: str, i: int) -> tuple[int, str, float]:
    t0 = time.monotonic()
    resp = await client.post(url, json={"model": "fake", "prompt": f"plain {i}",
                                        "max_tokens": 4, "temperature": 0})
    text = resp.json()["choices"][0]["text"] if resp.status_code == 200 else resp.text
    return resp.status_code, text, time.monotonic() - t0


def test_300_abandoned_streams_and_ordinary_requests_beside_them(env):
    e, gw = env
    r = redis.Redis.from_url(e.url)
    peak = [0]
    stop = threading.Event()

    def sample() -> None:           # the server's connections while the load runs
        while not stop.is_set():
            peak[0] = max(peak[0], r.info("clients")["connected_clients"])
            time.sleep(0.05)

    async def load() -> tuple[list, list]:
        limits = httpx.Limits(max_connections=STREAMS + ORDINARY + 10)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            left = [abandon(client, f"{gw.v1}/completions", i) for i in range(STREAMS)]
            plain = [ordinary(client, f"{gw.v1}/completions", i) for i in range(ORDINARY)]
            got = await asyncio.gather(*left, *plain)
        return got[:STREAMS], got[STREAMS:]

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        left, plain = asyncio.run(load())
    finally:
        stop.set()
        sampler.join(5)
    assert [s for s, _, _ in left if s != 200] == []
    assert [(s, t) for s, t, _ in plain if s != 200] == []
    assert [t for _, t, _ in plain] == [fake_completion(f"plain {i}", 4) for i in range(ORDINARY)]
    keys = Keys("many", "mq")

    def ended(job_id: str) -> bool:
        events = read_events(r, keys, job_id)
        return bool(events) and events[-1].type == "done"
    wait_for(lambda: all(ended(j) for _, j, _ in left), 30, interval=0.2,
             what="every abandoned job ended")
    for _, job_id, _ in left:
        done = read_events(r, keys, job_id)[-1]
        assert done.finish_reason == "cancelled", (job_id, done)
        # each left after 3 chunks; the cancel lands within a few steps of the whole batch
        assert done.usage.completion_tokens < 200, (job_id, done.usage)
    tokens = sorted(read_events(r, keys, j)[-1].usage.completion_tokens for _, j, _ in left)
    print(f"peak connections {peak[0]}, tokens of abandoned jobs: median {tokens[len(tokens) // 2]}, "
          f"max {tokens[-1]}")
    # 16 pooled connections, a few readers, the worker's and this test's: not one per request
    assert peak[0] < 45, peak[0]
    metrics = httpx.get(f"{gw.url}/metrics").text
    assert "tokenrelay_gateway_cancels_pending 0.0" in metrics
    assert "tokenrelay_gateway_streams_watched 0.0" in metrics     # nobody holds a reader
    assert 'status="5' not in metrics, [m for m in metrics.splitlines() if 'status="5' in m]
    r.close()
