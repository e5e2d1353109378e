"""Structured output and tool calls through the gateway over a real worker on our engine: the
tiny random-weight Qwen2 checkpoint with a chat template that renders tools in the Hermes
format (engine/tiny.py ``chat_template="tools"``), and SmolLM2 answering a real extraction
prompt in a schema (skipped without ``.models/smollm2``). The official ``openai`` client's
``parse(response_format=Model)`` returns a parsed instance; forced and ``auto`` tool calls
parse and validate against the tools' parameters (jsonschema), streamed and not; every
response is validated with openai's own types."""

from __future__ import annotations

import importlib.util
import json
from typing import Annotated, Any, Iterator

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.gateway.helpers import finish_reasons, stream_raw, strict_chunks
from tests.gateway.test_structured_fake import streamed_calls
from tests.sdk_helpers import RealWorker

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("single_thread"),
              pytest.mark.skipif(importlib.util.find_spec("tokenrelay.engine.llm_engine") is None,
                                 reason="the real engine is not available")]

ENGINE_KW = dict(kv_cache_memory_bytes=64 * 2**20, max_num_seqs=16, max_model_len=1024)
NAME = "tiny-tools"
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "maxLength": 10},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "required": ["zone"],
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
TOOLS = [WEATHER, CLOCK]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# A Hermes call in the answer, forced by a regex: random weights never write one by themselves.
HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,8}",'
               r' "days": [1-7]\}\}\n</tool_call>')


class Person(BaseModel):
    name: Annotated[str, Field(max_length=12)]
    age: Annotated[int, Field(ge=0, le=99)]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    from tokenrelay.engine.llm import LLM
    return LLM(str(tiny_checkpoint("qwen2", chat_template="tools")), **ENGINE_KW)


@pytest.fixture
def gw(redis_server, llm, gateway_factory) -> Iterator[Any]:
    w = RealWorker(redis_server.url, llm.engine, "gw-tools", served_model_name=NAME).start()
    try:
        yield gateway_factory(redis_server.url)
    finally:
        w.stop()


def chat(gw, body: dict, stream: bool = False):
    from openai.types.chat import ChatCompletion
    if stream:
        _, events = stream_raw(f"{gw.v1}/chat/completions", {"model": NAME, **body,
                                                              "stream": True})
        return strict_chunks(True, events)
    resp = httpx.post(f"{gw.v1}/chat/completions", json={"model": NAME, **body}, timeout=120)
    assert resp.status_code == 200, resp.text
    return ChatCompletion.model_validate(resp.json(), strict=True)


def valid_calls(calls: list[dict]) -> list[dict]:
    for c in calls:
        jsonschema.validate(json.loads(c["arguments"]), PARAMS[c["name"]])
    return calls


def as_dicts(tool_calls) -> list[dict]:
    return [{"name": c.function.name, "arguments": c.function.arguments} for c in tool_calls]


def test_parse_and_forced_tool_calls_on_the_tiny_model(gw, llm):
    assert llm.engine.tool_call_format == "hermes"
    client = openai.OpenAI(base_url=gw.v1, api_key="none", max_retries=0)
    out = client.chat.completions.parse(model=NAME, messages=CHAT, response_format=Person,
                                        max_tokens=120, temperature=0)
    assert isinstance(out.choices[0].message.parsed, Person), out.choices[0].message.content
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        body = {"messages": CHAT, "tools": TOOLS, "tool_choice": choice, "max_tokens": 160,
                "temperature": 1.0, "seed": 3}
        whole = chat(gw, body)
        assert whole.choices[0].finish_reason == "tool_calls"
        calls = valid_calls(as_dicts(whole.choices[0].message.tool_calls))
        assert choice == "required" or [c["name"] for c in calls] == ["get_time"]
        chunks = chat(gw, body, stream=True)
        assert finish_reasons(chunks) == {0: "tool_calls"}
        assert [{k: c[k] for k in ("name", "arguments")} for c in streamed_calls(chunks)] == \
            calls                               # the same seed: the same calls, streamed


def test_auto_renders_the_tools_and_reads_a_hermes_call_back(gw):
    plain = chat(gw, {"messages": CHAT, "max_tokens": 4, "temperature": 0})
    text = chat(gw, {"messages": CHAT, "tools": TOOLS, "max_tokens": 4, "temperature": 0})
    assert text.usage.prompt_tokens > plain.usage.prompt_tokens + 50   # the tools' block
    assert text.choices[0].message.tool_calls is None
    body = {"messages": CHAT, "tools": TOOLS, "max_tokens": 80, "temperature": 1.0, "seed": 5,
            "structured_outputs": {"regex": HERMES_CALL}}
    whole = chat(gw, body)
    msg = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and msg.content is None
    (call,) = valid_calls(as_dicts(msg.tool_calls))
    assert call["name"] == "get_weather" and msg.tool_calls[0].id.startswith("call_")
    chunks = chat(gw, body, stream=True)
    assert finish_reasons(chunks) == {0: "tool_calls"}
    assert [{k: c[k] for k in ("name", "arguments")} for c in streamed_calls(chunks)] == [call]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.timeout(420)
def test_smollm2_extracts_a_record_through_the_gateway(redis_server, gateway_factory):
    """A real model, a real extraction prompt, a strict schema: the openai client parses it."""
    from tokenrelay.engine.llm import LLM
    from tests.fixtures_models import smollm2_checkpoint

    folder = smollm2_checkpoint()

    class Record(BaseModel):
        name: Annotated[str, Field(max_length=40)]
        age: Annotated[int, Field(ge=0, le=150)]
        city: Annotated[str, Field(max_length=40)]

    llm = LLM(str(folder), max_model_len=512, num_kv_blocks=64, enforce_eager=True)
    w = RealWorker(redis_server.url, llm.engine, "gw-smol", served_model_name="smollm2").start()
    try:
        gw = gateway_factory(redis_server.url)
        client = openai.OpenAI(base_url=gw.v1, api_key="none", max_retries=0)
        text = ("Extract the person as JSON with keys name, age and city: \"Maria Lopez, 34, "
                "moved to Lisbon last spring to teach chemistry.\"")
        out = client.chat.completions.parse(
            model="smollm2", messages=[{"role": "user", "content": text}],
            response_format=Record, temperature=0, max_tokens=80)
        # auto with tools is refused: SmolLM2's template has no tool format
        with pytest.raises(openai.BadRequestError, match="does not render tools"):
            client.chat.completions.create(model="smollm2", messages=CHAT, tools=TOOLS)
    finally:
        w.stop()
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.parsed == Record(name="Maria Lopez", age=34, city="Lisbon")
