"""``submit(model=...)``, ``submit_many`` and ``tokenrelay submit --model`` route by the served
model, as the gateway and the batch runner do (#40), with the same ModelNotFound when no live
worker serves it, and nothing enqueued then."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from tests.fixtures_redis import REPO_ROOT
from tokenrelay.producer_sdk import AsyncClient, Client, InvalidRequest, ModelNotFound
from tokenrelay.producer_sdk.cli.main import EXIT_NO_WORKER
from tokenrelay.producer_sdk.gateway.errors import model_not_found
from tokenrelay.protocol.keys import Keys

pytestmark = pytest.mark.timeout(90)
GREEDY = {"max_tokens": 4, "temperature": 0.0}


@pytest.fixture
def two_models(redis_server, start_worker):
    start_worker(worker_id="wa", queue="qa", served_model_name="alpha")
    start_worker(worker_id="wb", queue="qb", served_model_name="beta")
    return redis_server


def test_submit_by_model_goes_to_its_queue_and_carries_the_model(two_models):
    with Client(two_models.url) as client:
        job = client.submit("hi", model="beta", **GREEDY)
        assert job.keys.queue == "qb"
        assert job.result(timeout=20).finish_reason in ("stop", "length")
        jobs = client.submit_many(["a", {"prompt": "b", "model": "alpha"}],
                                  model="beta", **GREEDY)
        assert [j.keys.queue for j in jobs] == ["qb", "qa"]
        assert all(j.result(timeout=20).outputs for j in jobs)
        assert client.queue_of_model("alpha") == "qa"


def test_a_model_nobody_serves_is_refused_with_nothing_enqueued(two_models):
    r = two_models.client()
    with Client(two_models.url) as client:
        with pytest.raises(ModelNotFound) as err:
            client.submit("hi", model="gamma", **GREEDY)
        with pytest.raises(ModelNotFound):
            client.submit_many(["a", {"prompt": "b", "model": "gamma"}], **GREEDY)
        with pytest.raises(InvalidRequest, match="model"):
            client.submit("hi", model=5)                       # hostile: not a name
        with pytest.raises(InvalidRequest, match="model"):
            client.submit("hi", model="two words", queue="qa")  # carried as is: validated
    assert "'gamma'" in str(err.value) and "alpha, beta" in str(err.value)
    # the gateway's 404 says the same
    assert str(err.value) in model_not_found("gamma", ["alpha", "beta"]).message
    for q in ("default", "qa", "qb"):
        assert sum(r.xlen(lane) for lane in Keys(queue=q).lanes()) == 0


def test_async_submit_by_model(two_models):
    async def go() -> str:
        async with AsyncClient(two_models.url) as client:
            job = await client.submit("hi", model="alpha", **GREEDY)
            await job.result(timeout=20)
            return job.keys.queue
    assert asyncio.run(go()) == "qa"


def test_cli_submit_model(two_models):
    def submit(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tokenrelay", "submit", "hi",
                               "--redis-url", two_models.url, "--max-tokens", "3",
                               "--temperature", "0", *args], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=60)
    ok = submit("--model", "beta")
    assert ok.returncode == 0, ok.stderr
    missing = submit("--model", "gamma")
    assert missing.returncode == EXIT_NO_WORKER
    assert "'gamma'" in missing.stderr and "alpha, beta" in missing.stderr
