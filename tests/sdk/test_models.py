"""Served model names: the worker's heartbeat advertises one, ``producer_sdk.core.models`` lists the
models of live workers across queues (a SIGKILLed worker drops out), and the TTL caches."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import redis.asyncio as aioredis

from tokenrelay.producer_sdk.core.models import AsyncModelCache, ModelCache, alist_models, list_models
from tokenrelay.protocol.heartbeat import Heartbeat
from tokenrelay.protocol.keys import Keys
from tokenrelay.worker.config import WorkerSettings, default_served_model_name


def test_default_served_model_name_is_the_checkpoint_folder():
    assert default_served_model_name("/models/Qwen3-8B/") == "Qwen3-8B"
    assert default_served_model_name(".models/smollm2") == "smollm2"
    assert default_served_model_name("fake:max_model_len=64") == "fake"
    s = WorkerSettings(model="/m/Llama", served_model_name="meta-llama/Llama-3.1-8B")
    assert s.served_model() == "meta-llama/Llama-3.1-8B"
    assert WorkerSettings(model="/m/Llama/").served_model() == "Llama"
    with pytest.raises(ValueError):
        WorkerSettings(model="x", served_model_name="two words")


@pytest.mark.timeout(60)
def test_heartbeat_carries_served_model_name_and_queue(redis_server, start_worker):
    run = start_worker(worker_id="hb1", queue="q1", served_model_name="alpha")
    r = redis_server.client()
    beat = {k.decode(): v.decode() for k, v in r.hgetall(Keys().heartbeat("hb1")).items()}
    assert beat["served_model_name"] == "alpha" and beat["queue"] == "q1"
    assert beat["model"] == "fake:"
    assert beat["tool_format"] == "hermes"          # what its "template" does with tools
    assert r.smembers(Keys().queues) == {b"q1"}
    models = list_models(r)
    assert list(models) == ["alpha"]
    assert models["alpha"].queues == ("q1",) and models["alpha"].workers == (("q1", "hb1"),)
    assert models["alpha"].tool_format == "hermes"
    assert abs(models["alpha"].created - time.time()) < 60
    assert run.stop() == 0
    assert list_models(r) == {}            # a clean exit deletes the heartbeat at once


def _wait(pred, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_live_models_across_queues_and_a_killed_worker_drops_out(redis_server, worker_process):
    """Three `tokenrelay worker --model fake:` processes: two serve alpha on q1 and q2's beta;
    after SIGKILL (no clean exit) the dead worker's heartbeat expires and it leaves the listing."""
    url = redis_server.url
    procs = {}
    for wid, queue, name in (("a1", "q1", "alpha"), ("a2", "q1", "alpha"), ("b1", "q2", "beta")):
        procs[wid] = worker_process("--model", "fake:", "--redis-url", url, "--worker-id", wid,
                                    "--queue", queue, "--served-model-name", name,
                                    "--heartbeat-ms", "100", "--block-ms", "50")
    for wp in procs.values():
        wp.wait_for_log('"worker ready"', 60)
    r = redis_server.client()
    models = list_models(r)
    assert sorted(models) == ["alpha", "beta"]
    assert models["alpha"].queues == ("q1",) and models["alpha"].queue == "q1"
    assert models["alpha"].workers == (("q1", "a1"), ("q1", "a2"))
    assert models["beta"].queues == ("q2",)

    async def listed() -> dict:
        client = aioredis.Redis.from_url(url)
        try:
            return await alist_models(client)
        finally:
            await client.aclose()
    assert asyncio.run(listed()) == models

    procs["b1"].signal(signal.SIGKILL)
    procs["a2"].signal(signal.SIGKILL)
    # Each killed worker's heartbeat expires on its own clock: wait for both to be gone.
    _wait(lambda: sorted(list_models(r)) == ["alpha"]
          and list_models(r)["alpha"].workers == (("q1", "a1"),))
    assert r.zscore(Keys(queue="q2").workers, "b1") is not None   # the registry lingers


def test_served_model_queue_prefers_the_queue_with_most_workers():
    from tokenrelay.producer_sdk.core.models import ServedModel
    m = ServedModel("m", ("a", "b"), (("a", "w1"), ("b", "w2"), ("b", "w3")), 0)
    assert m.queue == "b"
    assert ServedModel("m", ("b", "a"), (("a", "w1"), ("b", "w2")), 0).queue == "a"


@pytest.mark.timeout(60)
def test_model_caches_read_redis_once_per_ttl(redis_server):
    """A heartbeat written by hand (a worker would overwrite the renames below)."""
    r = redis_server.client()
    r.hset(Keys().heartbeat("c1"), mapping={"served_model_name": "alpha", "queue": "q1",
                                            "engine_loaded": 1, "draining": 0,
                                            "started_ms": 1000})
    r.zadd(Keys(queue="q1").workers, {"c1": 1})
    r.sadd(Keys().queues, "q1")
    now = [0.0]
    cache = ModelCache(r, ttl_s=5.0, clock=lambda: now[0])
    assert list(cache.get()) == ["alpha"]
    r.hset(Keys().heartbeat("c1"), "served_model_name", "renamed")
    assert list(cache.get()) == ["alpha"]          # within the TTL: no read
    now[0] = 5.1
    assert list(cache.get()) == ["renamed"]
    r.hset(Keys().heartbeat("c1"), "served_model_name", "again")
    cache.invalidate()
    assert list(cache.get()) == ["again"]

    async def run() -> tuple[list, list]:
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            acache = AsyncModelCache(client, ttl_s=5.0, clock=lambda: now[0])
            first = await asyncio.gather(*(acache.get() for _ in range(5)))
            r.hset(Keys().heartbeat("c1"), "served_model_name", "later")
            return [list(m) for m in first], list(await acache.get())
        finally:
            await client.aclose()
    first, cached = asyncio.run(run())
    assert first == [["again"]] * 5 and cached == ["again"]


def test_only_loaded_undrained_workers_of_the_queue_count():
    from tokenrelay.producer_sdk.core.models import _models
    pairs = [("q", "ok"), ("q", "broken"), ("q", "draining"), ("q", "moved"), ("q", "gone"),
             ("q", "old")]
    beats = [Heartbeat(served_model_name="m", queue="q", engine_loaded=True, started_ms=5000,
                       tool_format="hermes"),
             Heartbeat(served_model_name="m", queue="q", started_ms=1),
             Heartbeat(served_model_name="m", queue="q", engine_loaded=True, draining=True),
             Heartbeat(served_model_name="m", queue="other", engine_loaded=True),
             None, Heartbeat(queue="q", engine_loaded=True, started_ms=1)]
    models = _models(pairs, beats)
    assert list(models) == ["m"] and models["m"].workers == (("q", "ok"),)
    assert models["m"].created == 5 and models["m"].tool_format == "hermes"


def test_a_model_has_a_tool_format_only_when_every_live_worker_says_the_same():
    from tokenrelay.producer_sdk.core.models import _models
    pairs = [("q", "a"), ("q", "b")]

    def beat(fmt: str) -> Heartbeat:
        return Heartbeat(served_model_name="m", queue="q", engine_loaded=True, tool_format=fmt)
    assert _models(pairs, [beat("none"), beat("none")])["m"].tool_format == "none"
    assert _models(pairs, [beat("hermes"), beat("none")])["m"].tool_format is None
    assert _models(pairs, [beat("hermes"), beat("")])["m"].tool_format is None
    assert _models(pairs, [beat(""), beat("")])["m"].tool_format is None


def test_submit_to_another_queue_of_the_namespace(redis_server):
    """How a router sends a request for a model to its queue with one client: ``queue=``."""
    from tokenrelay.producer_sdk import AsyncClient, Client
    from tokenrelay.producer_sdk.errors import InvalidRequest
    with Client(redis_server.url, queue="qa") as client:
        job = client.submit("x", queue="qb", job_id="to-qb", priority=1)
        client.submit("x", job_id="to-qa")
        assert job.queue == "qb" and job.state.key == Keys(queue="qb").results("to-qb")
        assert client.status("to-qb", queue="qb").state == "queued"
        assert client.status("to-qb").state == "unknown"      # per-job keys are per queue
        with pytest.raises(InvalidRequest):
            client.submit("x", queue="bad:name")
        r = client.redis
        assert [f[b"data"] for _, f in r.xrange(Keys(queue="qb").lane("bulk"))]
        assert r.xlen(Keys(queue="qa").lane("default")) == 1
        assert r.get(Keys(queue="qb").dedupe("to-qb")).decode().startswith(
            Keys(queue="qb").lane("bulk"))

    async def run() -> None:
        async with AsyncClient(redis_server.url, queue="qa") as aclient:
            await aclient.submit("y", queue="qc", job_id="to-qc")
    asyncio.run(run())
    assert redis_server.client().xlen(Keys(queue="qc").lane("default")) == 1
