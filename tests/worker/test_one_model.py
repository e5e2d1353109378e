"""One model per queue (#40): a worker of another model refuses the queue (exit 78, one line),
the model listing never routes a model's requests to a queue of another, and a job for one
model is never answered by a worker of another, also when a worker restarts with another model.
"""

from __future__ import annotations

import json

import msgpack
import pytest

from tests.fault_harness import enqueue, submit, wait_for, wait_for_terminal
from tokenrelay.producer_sdk.core.models import list_models
from tokenrelay.protocol.heartbeat import Heartbeat, queue_model
from tokenrelay.protocol.keys import Keys
from tokenrelay.worker.connection import EXIT_CONFIG

pytestmark = pytest.mark.timeout(90)
KEYS = Keys()


def job(job_id: str, model: str) -> dict:
    return {"v": 1, "job_id": job_id, "prompt": "hello", "model": model,
            "params": {"max_tokens": 4, "temperature": 0.0}}


def test_queue_model_is_the_longest_running_workers() -> None:
    beats = {"w2": Heartbeat(served_model_name="beta", started_ms=20),
             "w1": Heartbeat(served_model_name="alpha", started_ms=10),
             "w0": Heartbeat(served_model_name="", started_ms=1)}     # an older worker
    assert queue_model(beats) == "alpha"
    assert queue_model({"b": Heartbeat(served_model_name="y", started_ms=5),
                        "a": Heartbeat(served_model_name="x", started_ms=5)}) == "x"
    assert queue_model({}) is None


def test_a_second_model_on_a_queue_exits_78_and_routing_never_mixes(redis_server, start_worker):
    r = redis_server.client()
    alpha = start_worker(worker_id="wa", served_model_name="alpha")
    beta = start_worker(worker_id="wb", served_model_name="beta", wait=False)
    beta.thread.join(20)
    assert beta.result == [EXIT_CONFIG]
    assert list(list_models(r)) == ["alpha"]
    assert not r.exists(KEYS.heartbeat("wb"))          # its beat is gone with it
    # a job for beta queued on alpha's queue is refused by name, never answered by alpha
    enqueue(r, KEYS, job("for-beta", "beta"))
    enqueue(r, KEYS, job("for-alpha", "alpha"))
    ends = wait_for_terminal(r, KEYS, ["for-beta", "for-alpha"])
    refused = ends["for-beta"][-1]
    assert refused.type == "error" and refused.code == "invalid_request"
    assert "'beta'" in refused.message and "'alpha'" in refused.message
    assert ends["for-alpha"][-1].type == "done"
    assert alpha.stop() == 0


def test_a_worker_restarted_with_another_model_never_answers_the_old_models_jobs(
        redis_server, start_worker):
    r = redis_server.client()
    first = start_worker(worker_id="w1", served_model_name="alpha")
    assert list(list_models(r)) == ["alpha"]
    assert first.stop() == 0
    enqueue(r, KEYS, job("queued-for-alpha", "alpha"))      # no live worker: it waits
    again = start_worker(worker_id="w1", served_model_name="beta")
    wait_for(lambda: list(list_models(r)) == ["beta"], 10, what="beta listed alone")
    refused = wait_for_terminal(r, KEYS, "queued-for-alpha")["queued-for-alpha"][-1]
    assert refused.type == "error" and "'alpha'" in refused.message
    enqueue(r, KEYS, job("for-beta", "beta"))
    assert wait_for_terminal(r, KEYS, "for-beta")["for-beta"][-1].type == "done"
    assert again.stop() == 0


def test_the_refusal_is_one_line_naming_both_models_and_the_fix(redis_server, start_worker,
                                                                worker_process):
    start_worker(worker_id="wa", served_model_name="alpha")
    wp = worker_process("--model", "fake:", "--served-model-name", "beta", "--worker-id", "wb",
                        "--redis-url", redis_server.url, "--heartbeat-ms", "200")
    assert wp.wait(60) == EXIT_CONFIG
    lines = [json.loads(line) for line in wp.log().splitlines() if line.startswith("{")]
    errors = [line for line in lines if line.get("level") == "error"]
    assert len(errors) == 1, errors
    message = errors[0]["event"]
    assert "'alpha'" in message and "'beta'" in message and "--queue" in message


@pytest.mark.parametrize("model", [5, "two words", "x" * 300, ""])
def test_a_hostile_model_field_ends_that_job_alone(redis_server, start_worker, model):
    r = redis_server.client()
    w = start_worker(worker_id="wa", served_model_name="alpha")
    raw = msgpack.packb({"v": 1, "job_id": "hostile", "prompt": "hi", "model": model})
    submit(r, KEYS, None, raw=raw)
    enqueue(r, KEYS, job("fine", "alpha"))
    ends = wait_for_terminal(r, KEYS, ["hostile", "fine"])
    assert ends["hostile"][-1].type == "error" and ends["hostile"][-1].code == "invalid_request"
    assert "model" in ends["hostile"][-1].message
    assert ends["fine"][-1].type == "done"
    assert w.stop() == 0


def test_a_worker_whose_queue_an_older_worker_of_another_model_serves_again_leaves(
        redis_server, start_worker):
    """A worker of alpha that was cut off (its beat expired) and comes back finds beta's
    worker, started meanwhile, on its queue: beta's, the younger, drains and exits 78."""
    r = redis_server.client()
    beta = start_worker(worker_id="wb", served_model_name="beta")
    older = Heartbeat(queue="default", served_model_name="alpha", started_ms=1,
                      engine_loaded=True, ts=1)
    r.hset(KEYS.heartbeat("wa"), mapping=older.encode())
    r.pexpire(KEYS.heartbeat("wa"), 30_000)
    r.zadd(KEYS.workers, {"wa": 1})
    beta.thread.join(20)
    assert beta.result == [EXIT_CONFIG]
    assert list(list_models(r)) == ["alpha"]
