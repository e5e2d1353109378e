"""Structured output and tools on the producer side: ``submit`` / ``submit_many`` / the async
client carry ``params.structured_outputs`` and ``tools`` through the one payload validation
(a bad schema is InvalidRequest naming the field, an oversized one refused by its size before
anything compiles it), the sampling cache keys keep a schema's property order, the CLI's
constraint flags, and OpenAI Batch lines with ``response_format`` and ``tools`` answered by a
fake worker whose engine walks the constraint (worker/fake_structured.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import msgpack
import pytest

from tokenrelay.producer_sdk import AsyncClient, Client, InvalidRequest
from tokenrelay.producer_sdk.batch.runner import BatchRunner
from tokenrelay.producer_sdk.jobs.payloads import ParamsCache, PayloadBuilder
from tokenrelay.protocol.keys import Keys
from tokenrelay.protocol.limits import Limits
from tokenrelay.protocol.structured_outputs import StructuredOutputsParams
from tests.sdk_helpers import env_with_repo
from tokenrelay.worker.fake_engine import FakeEngine, fake_constrained

pytestmark = pytest.mark.timeout(120)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
FLIPPED = {**SCHEMA, "properties": {"age": {"type": "integer"}, "name": {"type": "string"}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "required": ["city"],
                                          "additionalProperties": False,
                                          "properties": {"city": {"type": "string"}}}}}


def payload(prepared) -> dict:
    return msgpack.unpackb(prepared.payload, raw=False)


def test_the_params_cache_keeps_property_order_types_and_never_a_mutated_value():
    cache = ParamsCache()
    a = cache.validate({"structured_outputs": {"json": SCHEMA}})
    b = cache.validate({"structured_outputs": {"json": FLIPPED}})
    assert list(a["structured_outputs"]["json"]["properties"]) == ["name", "age"]
    assert list(b["structured_outputs"]["json"]["properties"]) == ["age", "name"]
    assert StructuredOutputsParams.model_validate(a["structured_outputs"]).canonical != \
        StructuredOutputsParams.model_validate(b["structured_outputs"]).canonical
    assert cache.validate({"seed": 1}) == {"seed": 1}
    with pytest.raises(InvalidRequest, match="seed"):         # True == 1, but not to strict
        cache.validate({"seed": True})
    stop = ["a"]
    assert cache.validate({"stop": stop}) == {"stop": ["a"]}
    stop.append("b")                                          # mutated after a submit
    assert cache.validate({"stop": stop}) == {"stop": ["a", "b"]}


def test_submit_carries_the_constraint_and_refuses_a_bad_one_before_sending():
    b = PayloadBuilder(Keys())
    for spec in ({"json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)):
        sent = payload(b.build("hi", structured_outputs=spec, max_tokens=9))
        assert sent["params"]["structured_outputs"]["json"] == SCHEMA
        assert list(sent["params"]["structured_outputs"]["json"]["properties"]) == ["name", "age"]
    with pytest.raises(InvalidRequest) as exc:
        b.build("hi", structured_outputs={"json": {"type": "array", "uniqueItems": True}})
    assert exc.value.field == "structured_outputs" and "uniqueItems" in str(exc.value)
    with pytest.raises(InvalidRequest, match="ignore_eos"):
        b.build("hi", structured_outputs={"regex": "a+"}, ignore_eos=True)
    # An oversized schema is refused by its size, before the sampling check compiles it.
    small = PayloadBuilder(Keys(), limits=Limits(max_schema_bytes=100))
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(200)}}
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequest, match="max_schema_bytes") as exc:
        small.build("hi", structured_outputs={"json": huge})
    assert exc.value.field == "params.structured_outputs.json"
    assert time.perf_counter() - t0 < 0.5


def test_tools_travel_with_chat_jobs_only_and_within_their_limits():
    b = PayloadBuilder(Keys(), limits=Limits(max_tools=2))
    msgs = [{"role": "user", "content": "weather?"}]
    sent = payload(b.build(messages=msgs, tools=[WEATHER]))
    assert sent["tools"] == [WEATHER]
    with pytest.raises(InvalidRequest, match="only a job with messages") as exc:
        b.build("a prompt", tools=[WEATHER])
    with pytest.raises(InvalidRequest, match="max_tools") as exc:
        b.build(messages=msgs, tools=[WEATHER] * 3)
    assert exc.value.field == "tools"
    with pytest.raises(InvalidRequest) as exc:
        b.build(messages=msgs, tools=[{"type": "function", "function": {"name": "no spaces"}}])
    assert exc.value.field.startswith("tools.0.function.name")
    with pytest.raises(InvalidRequest, match="unique"):
        b.build(messages=msgs, tools=[WEATHER, WEATHER])


@pytest.fixture
def fake(redis_server, start_worker):
    start_worker()
    return redis_server.url


def test_clients_get_constrained_answers_from_a_fake_worker(fake):
    msgs = [{"role": "user", "content": "Maria is 34."}]
    with Client(fake) as client:
        job = client.submit(messages=msgs, max_tokens=80, temperature=0,
                            structured_outputs={"json": SCHEMA})
        result = job.result(timeout=30)
        jsonschema.validate(json.loads(result.text), SCHEMA)
        assert result.finish_reason == "stop"
        assert (result.text, "stop") == fake_constrained(FakeEngine().render_chat(msgs),
                                                         {"json": SCHEMA}, 80)
        jobs = client.submit_many([{"prompt": "a", "structured_outputs": {"choice": ["x", "y"]}},
                                   {"prompt": "b", "structured_outputs": {"regex": r"\d{3}"}}],
                                  max_tokens=10)
        texts = [j.result(timeout=30).text for j in jobs]
        assert texts[0] in ("x", "y") and len(texts[1]) == 3 and texts[1].isdigit()
        with pytest.raises(InvalidRequest):
            client.submit("x", structured_outputs={"regex": "(abc"})

    async def run() -> str:
        async with AsyncClient(fake) as aclient:
            job = await aclient.submit("x", max_tokens=200, seed=1,
                                       structured_outputs={"json": FLIPPED})
            return (await job.result(timeout=30)).text
    text = asyncio.run(run())
    assert list(json.loads(text)) == ["age", "name"]        # the order the schema gave


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenrelay.producer_sdk", *args], capture_output=True,
                          text=True, timeout=60, env=env_with_repo())


def test_cli_constraint_flags(fake, tmp_path: Path):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    res = cli("submit", "Maria is 34.", "--chat", "--redis-url", fake, "--max-tokens", "200",
              "--seed", "1", "--json-schema", str(schema_file))
    assert res.returncode == 0, res.stderr
    jsonschema.validate(json.loads(res.stdout), SCHEMA)
    res = cli("submit", "pick", "--redis-url", fake, "--choice", "left", "--choice", "right",
              "--max-tokens", "8", "--stream")
    assert res.returncode == 0 and res.stdout.strip() in ("left", "right"), res.stderr
    res = cli("submit", "n", "--redis-url", fake, "--json-schema", '{"type": "integer"}',
              "--max-tokens", "8", "--seed", "1")
    assert res.returncode == 0 and isinstance(json.loads(res.stdout), int)
    bad = cli("submit", "x", "--redis-url", fake, "--regex", "(abc")
    assert bad.returncode == 2 and "--regex: " in bad.stderr and "unclosed" in bad.stderr
    two = cli("submit", "x", "--redis-url", fake, "--regex", "a", "--json-object")
    assert two.returncode == 2 and "--json-object" in two.stderr


def line(cid: str, **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "fake", "max_tokens": 120, "temperature": 0,
                                "messages": [{"role": "user", "content": cid}], **body}})


def test_batch_lines_with_response_format_and_tools(redis_server, start_worker, tmp_path: Path):
    start_worker()
    start_worker(engine=FakeEngine(tool_format="none"), worker_id="plain", queue="plain",
                 served_model_name="plain")
    schema = {"name": "person", "strict": True, "schema": SCHEMA}
    inp, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    inp.write_text("\n".join([
        line("schema", response_format={"type": "json_schema", "json_schema": schema}),
        line("object", response_format={"type": "json_object"}),
        line("required", tools=[WEATHER], tool_choice="required"),
        line("named", tools=[WEATHER], tool_choice={"type": "function",
                                                    "function": {"name": "get_weather"}}),
        line("auto", tools=[WEATHER], max_tokens=5),
        line("auto-plain", model="plain", tools=[WEATHER]),
        line("required-plain", model="plain", tools=[WEATHER], tool_choice="required"),
        line("bad", response_format={"type": "json_schema", "json_schema": {
            "name": "x", "strict": True, "schema": {"type": "array", "uniqueItems": True}}}),
    ]) + "\n")
    with Client(redis_server.url) as client:
        summary = BatchRunner(client, inp, out, err, progress=False).run()
    assert (summary.succeeded, summary.malformed + summary.failed) == (6, 2)
    from openai.types.chat import ChatCompletion
    results = {o["custom_id"]: ChatCompletion.model_validate(o["response"]["body"], strict=True)
               for o in map(json.loads, out.read_text().splitlines())}
    msg = {cid: r.choices[0].message for cid, r in results.items()}
    jsonschema.validate(json.loads(msg["schema"].content), SCHEMA)
    assert isinstance(json.loads(msg["object"].content), dict)
    for cid in ("required", "named", "required-plain"):
        assert results[cid].choices[0].finish_reason == "tool_calls", cid
        (call,) = msg[cid].tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments),
                            WEATHER["function"]["parameters"])
    assert msg["auto"].tool_calls is None and len(msg["auto"].content) == 5
    errors = {e["custom_id"]: e["error"] for e in map(json.loads, err.read_text().splitlines())}
    assert errors["bad"]["message"].startswith("response_format.json_schema.schema: ")
    assert "tool_choice 'auto'" in errors["auto-plain"]["message"]
