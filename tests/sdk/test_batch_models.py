"""The batch runner routes each line by ``body.model`` to the queue of the live workers serving
it (two ``tokenrelay worker --model fake:`` processes on two queues), writes the served model
name, sends unknown models to the errors file (OpenAI's 404 ``model_not_found``), and its
logprobs output validates with the openai package's own types."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from tokenrelay.producer_sdk import Client
from tokenrelay.producer_sdk.batch.runner import BatchRunner
from tokenrelay.protocol.keys import EVENT_FIELD, Keys
from tests.sdk.test_batch_runner import read_jsonl
from tests.sdk_helpers import env_with_repo


def line(cid: str, url: str = "/v1/chat/completions", **body) -> str:
    if url == "/v1/chat/completions":
        body.setdefault("messages", [{"role": "user", "content": cid}])
    else:
        body.setdefault("prompt", cid)
    return json.dumps({"custom_id": cid, "method": "POST", "url": url,
                       "body": {"max_tokens": 4, "temperature": 0, **body}})


def served_by(r, job_id: str, queue: str) -> str:
    """The worker that ran a job of ``queue``: its ``started`` event says."""
    for _, fields in r.xrange(Keys(queue=queue).results(job_id)):
        event = msgpack.unpackb(fields[EVENT_FIELD], raw=False, strict_map_key=False)
        if event["type"] == "started":
            return event["worker_id"]
    raise AssertionError(f"{job_id} never started")


@pytest.fixture
def two_models(redis_server, worker_process):
    procs = [worker_process("--model", "fake:", "--redis-url", redis_server.url, "--worker-id",
                            wid, "--queue", queue, "--served-model-name", name,
                            "--heartbeat-ms", "200", "--block-ms", "50")
             for wid, queue, name in (("wa", "qa", "alpha"), ("wb", "qb", "beta"))]
    for wp in procs:
        wp.wait_for_log('"worker ready"', 60)
    return redis_server


@pytest.mark.timeout(120)
def test_lines_are_routed_by_model_and_unknown_models_are_404(two_models, tmp_path: Path):
    inp, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    inp.write_text("\n".join([
        line("a1", model="alpha"), line("b1", model="beta"),
        line("b2", "/v1/completions", model="beta"), line("g1", model="gamma"),
        line("none")]) + "\n")
    with Client(two_models.url, queue="qa") as client:
        summary = BatchRunner(client, inp, out, err, batch_id="route", progress=False).run()
        r = client.redis
        outputs = {o["custom_id"]: o for o in read_jsonl(out)}
        assert (summary.succeeded, summary.failed, summary.malformed) == (3, 1, 1)
        assert {c: o["response"]["body"]["model"] for c, o in outputs.items()} == {
            "a1": "alpha", "b1": "beta", "b2": "beta"}
        queue_of = {"a1": "qa", "b1": "qb", "b2": "qb"}
        assert {c: served_by(r, o["response"]["request_id"], queue_of[c])
                for c, o in outputs.items()} == {"a1": "wa", "b1": "wb", "b2": "wb"}
    error, no_model = sorted(read_jsonl(err), key=lambda e: e["error"]["line"])
    assert (no_model["custom_id"], no_model["error"]["param"]) == ("none", "model")
    assert error["custom_id"] == "g1" and error["error"]["code"] == "model_not_found"
    assert error["response"]["status_code"] == 404
    assert error["response"]["body"]["error"] == {
        "message": error["error"]["message"], "type": "invalid_request_error",
        "param": "model", "code": "model_not_found"}
    assert "alpha, beta" in error["error"]["message"]
    status = subprocess.run(           # each job is found on the queue its line was routed to
        [sys.executable, "-m", "tokenrelay.producer_sdk", "status", "--batch", str(inp), "--batch-id",
         "route", "--queue", "qa", "--redis-url", two_models.url, "--json"],
        capture_output=True, text=True, timeout=60, env=env_with_repo())
    rows = [json.loads(x) for x in status.stdout.splitlines()]
    states = {x["custom_id"]: x["state"] for x in rows if "custom_id" in x}
    assert states == {"a1": "done", "b1": "done", "b2": "done", "g1": "unknown"}, status.stderr
    assert [x["line"] for x in rows if "malformed" in x] == [5]      # the line without model


@pytest.mark.timeout(120)
def test_batch_logprobs_validate_with_openais_types(two_models, tmp_path: Path):
    inp, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    inp.write_text("\n".join([
        line("chat", model="alpha", logprobs=True, top_logprobs=2, n=2, seed=1,
             temperature=0.8),
        line("chat0", model="alpha", logprobs=True),
        line("cmpl", "/v1/completions", model="beta", logprobs=3)]) + "\n")
    with Client(two_models.url, queue="qa") as client:
        summary = BatchRunner(client, inp, out, err, batch_id="lp", progress=False).run()
    assert summary.succeeded == 3, read_jsonl(err)
    bodies = {o["custom_id"]: o["response"]["body"] for o in read_jsonl(out)}
    chat = ChatCompletion.model_validate(bodies["chat"], strict=True)
    assert len(chat.choices) == 2
    for choice in chat.choices:
        content = choice.logprobs.content
        assert "".join(t.token for t in content) == choice.message.content
        for t in content:
            assert t.bytes == list(t.token.encode()) and len(t.top_logprobs) == 2
            assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob
    chat0 = ChatCompletion.model_validate(bodies["chat0"], strict=True)
    assert all(t.top_logprobs == [] for t in chat0.choices[0].logprobs.content)
    cmpl = Completion.model_validate(bodies["cmpl"], strict=True)
    lp = cmpl.choices[0].logprobs
    assert "".join(lp.tokens) == cmpl.choices[0].text and len(lp.tokens) == 4
    assert lp.token_logprobs == [-0.5] * 4 and lp.text_offset == [0, 1, 2, 3]
    assert all(len(top) == 3 and top[tok] == -0.5 for tok, top in zip(lp.tokens,
                                                                       lp.top_logprobs))


@pytest.mark.timeout(60)
def test_without_live_workers_lines_wait_on_the_only_queue_but_not_on_a_guess(redis_server,
                                                                             tmp_path: Path):
    """Nothing live advertises a model: with one queue in the namespace the lines are queued
    there for workers to come (nothing consumes them here, so they stay queued); with several
    the runner cannot tell which, and a line naming a model is model_not_found."""
    inp, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    inp.write_text(line("x1", model="alpha") + "\n")
    with Client(redis_server.url, queue="qa") as client:
        runner = BatchRunner(client, inp, out, err, batch_id="wait", progress=False)
        assert runner.router.route("alpha") == (None, "alpha")
        client.redis.sadd(client.keys.queues, "qa", "qb")
        runner.router._only_queue = None
        with pytest.raises(Exception) as exc:
            runner.router.route("alpha")
        assert getattr(exc.value, "code", None) == "model_not_found"
        assert runner.run().failed == 1
    assert read_jsonl(err)[0]["error"]["code"] == "model_not_found"
