"""A Redis restarted without its data while jobs stream (issue #25): the worker loses its jobs
("lease lost") and no one will ever write to their streams again. Every reader learns within
seconds that the job's records are gone. Readers that hold the request put it back in its
queue under the same id and keep streaming from what they have (the sync and async SDK, the
gateway's SSE, the batch runner): each ends with exactly the full completion, each token once.
A reader that does not hold it (``Client.get(id)``) ends ``job_lost``.

Jobs here are greedy so the texts compare exactly with one run; sampled jobs through the same
restart (the worker never recreates a lost job's records, so no stream mixes two samples) are
tests/faults/test_redis_restarts.py's, and the seed a reader's rerun carries is tested in
tests/sdk/test_shared_readers.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import pytest

from tokenrelay.producer_sdk import AsyncClient
from tokenrelay.producer_sdk.batch.runner import BatchRunner
from tokenrelay.producer_sdk.errors import JobFailed
from tests.fault_harness import FaultEnv, wait_for
from tests.gateway.helpers import GatewayProcess, sse_events
from tokenrelay.worker.fake_engine import fake_completion

pytestmark = pytest.mark.timeout(180)
TOKENS = 60


class Reader(threading.Thread):
    """Runs ``fn`` in a thread; keeps what it returned or raised, and when."""

    def __init__(self, fn: Any) -> None:
        super().__init__(daemon=True)
        self.fn, self.value, self.error, self.ended = fn, None, None, 0.0

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as exc:     # checked by the test
            self.error = exc
        self.ended = time.monotonic()


def test_readers_rerun_or_end_a_job_redis_lost(tmp_path):
    env = FaultEnv(tmp_path, namespace="lost", queue="lq")
    gw = None
    try:
        env.worker("w1", delay=0.05, max_num_seqs=32)
        gw = GatewayProcess(tmp_path / "gateway.log", "--redis-url", env.url, "--namespace",
                            "lost", "--status-wait-s", "0.2").wait_up()
        producer, other = env.client(), env.client()
        sync_job = producer.submit("sync reader", max_tokens=TOKENS, temperature=0)
        by_id = other.submit("read by id", max_tokens=TOKENS, temperature=0)
        seen: dict[str, list[str]] = {"sync": [], "async": [], "gateway": []}

        def sync_stream() -> str:
            for d in sync_job.stream(timeout=90):
                seen["sync"].append(d.text)
            return sync_job.result(timeout=5).text

        async def async_stream() -> tuple[str, int]:
            async with AsyncClient(env.url, queue="lq", namespace="lost") as ac:
                job = await ac.submit("async reader", max_tokens=TOKENS, temperature=0)
                async for d in job.stream(timeout=90):
                    seen["async"].append(d.text)
                return (await job.result(timeout=5)).text

        def gateway_stream() -> str:
            with httpx.stream("POST", f"{gw.v1}/completions", timeout=90, json={
                    "model": "fake", "prompt": "gateway reader", "max_tokens": TOKENS,
                    "temperature": 0, "stream": True}) as resp:
                for kind, obj in sse_events(resp.iter_lines()):
                    if kind == "data":
                        assert "error" not in obj, obj
                        seen["gateway"].append(obj["choices"][0]["text"] if obj["choices"]
                                               else "")
            return "".join(seen["gateway"])

        inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        inp.write_text("".join(json.dumps({
            "custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
            "body": {"model": "fake", "prompt": f"batch {i}", "max_tokens": TOKENS,
                     "temperature": 0}}) + "\n" for i in range(4)))

        def batch() -> Any:
            return BatchRunner(env.client(), inp, out, batch_id="lostb", concurrency=4,
                               progress=False).run()

        readers = {"sync": Reader(sync_stream),
                   "async": Reader(lambda: asyncio.run(async_stream())),
                   "gateway": Reader(gateway_stream), "batch": Reader(batch),
                   "by id": Reader(lambda: env.client().get(by_id.id).result(timeout=90))}
        for r in readers.values():
            r.start()
        wait_for(lambda: all(len(seen[k]) >= 5 for k in seen), 60, what="every reader reading")
        env.redis.restart()                         # no persistence: everything is gone
        restarted = time.monotonic()
        for r in readers.values():
            r.join(120)
        # the reader without the request: job_lost, within seconds
        lost = readers["by id"]
        assert isinstance(lost.error, JobFailed) and lost.error.code == "job_lost", lost.error
        assert lost.ended - restarted < 10, lost.ended - restarted
        # readers with it: the whole completion, each token once
        assert readers["sync"].error is None, readers["sync"].error
        want = fake_completion("sync reader", TOKENS)
        assert readers["sync"].value == "".join(seen["sync"]) == want
        assert sync_job.state.reruns >= 1
        assert readers["async"].error is None, readers["async"].error
        text = readers["async"].value
        assert text == "".join(seen["async"]) == fake_completion("async reader", TOKENS)
        assert readers["gateway"].error is None, readers["gateway"].error
        assert readers["gateway"].value == fake_completion("gateway reader", TOKENS)
        assert readers["batch"].error is None, readers["batch"].error
        lines = {json.loads(line)["custom_id"]: json.loads(line)
                 for line in out.read_text().splitlines()}
        assert {k: v["response"]["body"]["choices"][0]["text"] for k, v in lines.items()} == \
            {f"c{i}": fake_completion(f"batch {i}", TOKENS) for i in range(4)}
    finally:
        if gw is not None:
            gw.stop()
        env.close()
