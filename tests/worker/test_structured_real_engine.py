"""Structured outputs through the worker, on the real engine (tiny random-weight checkpoint):
a constraint that fails ends its job alone, whether the payload validation refuses it (a raw
producer's bad regex) or only the engine can (a grammar naming a token this tokenizer lacks),
and a JSON answer handed over mid-way resumes exactly.
"""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from tokenrelay.protocol.keys import Keys
from tests.fault_harness import read_events, submit, wait_for_terminal
from tests.worker.test_real_engine import ENGINE_KW, start, stop

KEYS = Keys()
LONG = {"type": "object", "additionalProperties": False, "required": ["items"],
        "properties": {"items": {"type": "array", "minItems": 6, "maxItems": 6,
                                 "items": {"type": "string", "maxLength": 4}}}}


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    from tokenrelay.engine.llm import LLM
    return LLM(str(tiny_checkpoint("llama")), **ENGINE_KW)


@pytest.fixture
def engine(llm):
    yield llm.engine
    for rid in list(llm.engine.requests):
        llm.engine.abort_request(rid)


def test_a_failing_constraint_ends_its_job_alone(redis_server, llm, engine):
    import msgpack

    from tokenrelay.engine.sampling_params import SamplingParams
    good = {"temperature": 1.0, "seed": 4, "max_tokens": 60,
            "structured_outputs": {"json": LONG}}
    ref = llm.generate("List:", SamplingParams.model_validate(good))[0].outputs[0]
    r = redis_server.client()
    w, t = start(redis_server, engine)
    try:
        submit(r, KEYS, {"job_id": "plain", "prompt": "Hello",
                         "params": {"temperature": 0, "max_tokens": 30}})
        submit(r, KEYS, {"job_id": "engine-refuses", "prompt": "Hello", "params": {
            "max_tokens": 8, "structured_outputs": {"grammar": 'start: <|no_such|> "a"'}}})
        raw = msgpack.packb({"v": 1, "job_id": "bad-regex", "prompt": "Hello",
                             "params": {"structured_outputs": {"regex": "(abc"}}})
        submit(r, KEYS, None, raw=raw)
        submit(r, KEYS, {"job_id": "json", "prompt": "List:", "params": good})
        out = wait_for_terminal(r, KEYS, ["plain", "engine-refuses", "bad-regex", "json"], 60)
    finally:
        stop(w, t)
    for jid, words in (("engine-refuses", "no_such"), ("bad-regex", "unclosed group")):
        last = out[jid][-1]
        assert last.type == "error" and last.code == "invalid_request", jid
        assert last.message.startswith("params.structured_outputs") and words in last.message
    assert out["plain"][-1].type == "done"
    events = out["json"]
    text = "".join(e.text for e in events if e.type == "token")
    assert events[-1].type == "done" and text == ref.text and ref.finish_reason == "stop"
    jsonschema.validate(json.loads(text), LONG)


def test_takeover_resumes_a_json_answer_exactly(redis_server, llm, engine):
    from tokenrelay.engine.sampling_params import SamplingParams
    params = {"temperature": 1.0, "max_tokens": 80, "structured_outputs": {"json": LONG}}
    r = redis_server.client()
    w1, t1 = start(redis_server, engine, worker_id="first", drain_timeout=0.0)
    submit(r, KEYS, {"job_id": "half", "prompt": "List:", "params": params})
    deadline = time.monotonic() + 30
    while len([e for e in read_events(r, KEYS, "half") if e.type == "token"]) < 5:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    stop(w1, t1, force=True)
    first = read_events(r, KEYS, "half")
    assert first[-1].type == "token", "the job should have been handed back unfinished"
    w2, t2 = start(redis_server, engine, worker_id="second")
    try:
        events = wait_for_terminal(r, KEYS, "half", 60)["half"]
    finally:
        stop(w2, t2)
    seed = first[0].seed
    ref = llm.generate("List:", SamplingParams.model_validate({**params, "seed": seed})
                       )[0].outputs[0]
    ids = [tid for e in events if e.type == "token" for tid in e.token_ids]
    text = "".join(e.text for e in events if e.type == "token")
    assert [e.worker_id for e in events if e.type == "started"] == ["first", "second"]
    assert ids == ref.token_ids and text == ref.text
    if ref.finish_reason == "stop":
        jsonschema.validate(json.loads(text), LONG)
