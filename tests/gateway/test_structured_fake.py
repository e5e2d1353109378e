"""Structured output and tool calls through the gateway with the official ``openai`` client,
over an in-process worker on the FakeEngine, which walks the constraint's grammar
deterministically (worker/fake_structured.py): ``parse(response_format=Model)`` returns a
parsed instance, vLLM's extras and ``response_format`` become the one job field, tool calls
(required, named, auto, none) come back as ``message.tool_calls`` and as tool-call deltas, every
response validated strictly with openai's own types, and bad constraints are 400s naming the
field as the caller wrote it. Where validity depends on a real model's tokens the real tiny
engine is used instead (test_structured_real.py)."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.gateway.helpers import finish_reasons, stream_raw, strict_chunks
from tokenrelay.worker.fake_engine import FakeEngine, fake_completion, fake_constrained

pytestmark = pytest.mark.timeout(120)
MODEL = "fake"
CHAT = [{"role": "user", "content": "Extract the person."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "minLength": 2},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "required": ["tz"],
                                       "properties": {"tz": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


class Person(BaseModel):
    name: str
    age: int
    role: Literal["admin", "user"]


def rendered(messages=CHAT, tools=None) -> str:
    return FakeEngine().render_chat(messages, tools=tools)


@pytest.fixture
def gw(redis_server, start_worker, gateway_factory):
    start_worker()
    return gateway_factory(redis_server.url)


def oai(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key="none", max_retries=0)


def post(gw, body: dict, url: str = "/chat/completions") -> httpx.Response:
    return httpx.post(gw.v1 + url, json={"model": MODEL, **body}, timeout=30)


def whole(gw, body: dict, url: str = "/chat/completions"):
    """A 200 response body, validated strictly as openai's ChatCompletion."""
    from openai.types.chat import ChatCompletion
    resp = post(gw, body, url)
    assert resp.status_code == 200, resp.text
    return ChatCompletion.model_validate(resp.json(), strict=True)


def test_parse_with_a_pydantic_model_returns_a_parsed_instance(gw):
    client = oai(gw)
    out = client.chat.completions.parse(model=MODEL, messages=CHAT, response_format=Person,
                                        max_tokens=200, temperature=0)
    msg = out.choices[0].message
    assert isinstance(msg.parsed, Person) and out.choices[0].finish_reason == "stop"
    assert msg.parsed == Person.model_validate_json(msg.content)
    # The same request on the raw wire: the schema the client sent, strict, constrained.
    schema = openai.lib._pydantic.to_strict_json_schema(Person)
    body = {"messages": CHAT, "max_tokens": 200, "temperature": 0, "response_format": {
        "type": "json_schema", "json_schema": {"name": "Person", "schema": schema,
                                               "strict": True}}}
    raw = whole(gw, body)
    text, reason = fake_constrained(rendered(), {"json": schema}, 200)
    assert raw.choices[0].message.content == text == msg.content and reason == "stop"
    # Streamed: the same text in content deltas, validated chunk by chunk.
    _, events = stream_raw(f"{gw.v1}/chat/completions", {"model": MODEL, **body,
                                                          "stream": True})
    chunks = strict_chunks(True, events)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert finish_reasons(chunks) == {0: "stop"}


@pytest.mark.parametrize("body, check", [
    ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    ({"guided_json": {"type": "array", "items": {"type": "integer"}, "minItems": 2}},
     lambda t: len(json.loads(t)) >= 2),
    ({"guided_regex": r"[A-Z]{3}-\d{4}"}, lambda t: len(t) == 8 and t[3] == "-"),
    ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ({"guided_grammar": 'start: "ab" ("c" | "d")'}, lambda t: t in ("abc", "abd")),
    ({"response_format": {"type": "text"}}, lambda t: t == fake_completion(rendered(), 64)),
])
def test_every_spelling_of_a_constraint_constrains_the_answer(gw, body, check):
    out = whole(gw, {"messages": CHAT, "max_tokens": 64, "temperature": 0, **body})
    assert check(out.choices[0].message.content), out.choices[0].message.content


def test_completions_and_n_choices_are_constrained_too(gw):
    from openai.types import Completion
    schema = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}
    resp = post(gw, {"prompt": "Count:", "max_tokens": 40, "n": 3, "temperature": 1.0,
                     "seed": 4, "response_format": {"type": "json_schema", "json_schema": {
                         "name": "count", "schema": schema, "strict": True}}}, "/completions")
    comp = Completion.model_validate(resp.json(), strict=True)
    texts = [c.text for c in comp.choices]
    for i, t in enumerate(texts):
        jsonschema.validate(json.loads(t), schema)
        assert (t, "stop") == fake_constrained("Count:", {"json": schema}, 40, seed=4,
                                                greedy=False, choice=i)
    assert len(set(texts)) > 1, "seeded choices should differ"


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format.json_schema.schema", "uniqueItems"),
    ({"guided_regex": "(abc"}, "guided_regex", "unclosed group"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs",
     "exactly one of"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "both"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name", "name"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "nope"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name",
     "pattern"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_choice": ["a"]}, "tool_choice",
     "constrains"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"guided_choice": ["x" * 2000]}, "guided_choice", "max_choice_chars"),
])
def test_a_bad_constraint_is_a_400_naming_the_field_as_the_caller_wrote_it(gw, body, param,
                                                                           words):
    resp = post(gw, {"messages": CHAT, **body})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and words in err["message"], err
    if words in ("uniqueItems", "unclosed group", "exactly one of", "max_choice_chars"):
        # refused by the one payload validation (params.structured_outputs), then renamed
        assert err["message"].startswith(param + ": ") and "params." not in err["message"]
    with pytest.raises(openai.BadRequestError):
        oai(gw).chat.completions.create(model=MODEL, messages=CHAT, extra_body=body)


def test_a_non_strict_schema_is_followed_best_effort(gw):
    schema = {"type": "array", "uniqueItems": True, "items": {"type": "integer"},
              "minItems": 1}
    out = whole(gw, {"messages": CHAT, "max_tokens": 200, "seed": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "ints", "schema": schema}}})
    assert all(isinstance(v, int) for v in json.loads(out.choices[0].message.content))


def check_calls(calls, names=("get_weather", "get_time")) -> list:
    """Each call: an id, a known function, arguments that parse and validate."""
    for c in calls:
        assert c.id.startswith("call_") and c.type == "function" and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), PARAMS[c.function.name])
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def streamed_calls(chunks) -> list:
    """The tool calls of chunk deltas, assembled as an OpenAI client does: the first delta
    of a call carries id, type and name; later ones append argument fragments."""
    calls: dict[int, dict] = {}
    for ch in chunks:
        for choice in ch.choices:
            for d in choice.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name, d
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_whole_and_streamed(gw, tool_choice):
    body = {"messages": CHAT, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 200,
            "temperature": 1.0, "seed": 11}
    out = whole(gw, body)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and msg.content is None
    calls = check_calls(msg.tool_calls)
    assert calls and (tool_choice == "required" or calls[0][0] == "get_weather")
    _, events = stream_raw(f"{gw.v1}/chat/completions", {"model": MODEL, **body,
                                                          "stream": True})
    chunks = strict_chunks(True, events)
    assert finish_reasons(chunks) == {0: "tool_calls"}
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    got = streamed_calls(chunks)           # the same seeded calls (ids name each job's own)
    assert [(c["name"], c["arguments"]) for c in got] == \
        [(c.function.name, c.function.arguments) for c in msg.tool_calls]
    assert len({c["id"] for c in got} | {c.id for c in msg.tool_calls}) == 2 * len(got)
    # The openai client's own parsing of the same request.
    parsed = oai(gw).chat.completions.create(model=MODEL, **body)
    assert check_calls(parsed.choices[0].message.tool_calls) == calls


def test_required_without_parallel_calls_makes_one_call(gw):
    out = whole(gw, {"messages": CHAT, "tools": TOOLS, "tool_choice": "required",
                     "parallel_tool_calls": False, "max_tokens": 200, "seed": 3})
    assert len(check_calls(out.choices[0].message.tool_calls)) == 1


def test_auto_renders_the_tools_and_answers_in_text_when_no_call_is_made(gw):
    out = whole(gw, {"messages": CHAT, "tools": TOOLS, "max_tokens": 6, "temperature": 0})
    want = fake_completion(rendered(tools=TOOLS), 6)
    assert out.choices[0].message.content == want and not out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(rendered(tools=TOOLS))
    none = whole(gw, {"messages": CHAT, "tools": TOOLS, "tool_choice": "none",
                      "max_tokens": 6, "temperature": 0})
    assert none.choices[0].message.content == fake_completion(rendered(), 6)
    _, events = stream_raw(f"{gw.v1}/chat/completions", {
        "model": MODEL, "messages": CHAT, "tools": TOOLS, "max_tokens": 6, "temperature": 0,
        "stream": True})
    chunks = strict_chunks(True, events)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


def test_a_model_whose_template_has_no_tool_format_refuses_auto_but_takes_forced_calls(
        redis_server, start_worker, gateway_factory):
    start_worker(engine=FakeEngine(tool_format="none"))
    gw = gateway_factory(redis_server.url)
    resp = post(gw, {"messages": CHAT, "tools": TOOLS})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == "tool_choice" and "does not render tools" in err["message"]
    out = whole(gw, {"messages": CHAT, "tools": TOOLS, "tool_choice": "required",
                     "max_tokens": 200, "seed": 4})
    check_calls(out.choices[0].message.tool_calls)
    # the tools were left out of the job: this "template" would have refused them
    assert out.usage.prompt_tokens == len(rendered())


def test_a_multi_turn_tool_conversation_renders(gw):
    messages = CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    out = whole(gw, {"messages": messages, "tools": TOOLS, "max_tokens": 4,
                     "temperature": 0})
    want = [{"role": "user", "content": CHAT[0]["content"]},
            {"role": "assistant", "content": ""}, {"role": "tool", "content": "rain"}]
    assert out.choices[0].message.content == fake_completion(rendered(want, TOOLS), 4)
