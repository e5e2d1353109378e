"""``tools`` in the job contract (protocol/tools.py): the worker's validation of the field
(OpenAI's shape, chat jobs only, unique names, its limits, named as the field), the template
variable it stays reserved as, the forced-call schema and assistant tool calls as templates
read them."""

from __future__ import annotations

import jsonschema
import msgpack
import pytest

from tokenrelay.protocol.errors import ProtocolError
from tokenrelay.protocol.limits import Limits
from tokenrelay.protocol.structured_outputs import StructuredOutputsParams
from tokenrelay.protocol.tools import Tool, call_schema, template_tool_calls
from tokenrelay.protocol.wire import decode_job

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather", "parameters": {
        "type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}
CHAT = [{"role": "user", "content": "hi"}]


def job(**fields) -> bytes:
    """A chat job's payload with ``fields`` (a None drops the field)."""
    payload = {"v": 1, "job_id": "j", "messages": CHAT, **fields}
    return msgpack.packb({k: v for k, v in payload.items() if v is not None})


def test_tools_round_trip_the_wire_and_reach_the_template_as_given():
    req = decode_job(job(tools=[WEATHER]))
    assert req.tool_dicts() == [WEATHER]
    assert decode_job(job()).tool_dicts() is None


@pytest.mark.parametrize("fields, field, words", [
    ({"tools": [WEATHER], "messages": None, "prompt": "x"}, None, "only a job with messages"),
    ({"tools": [WEATHER, WEATHER]}, None, "unique"),
    ({"tools": []}, "tools", "at least 1"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "function"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools.0.function.name", "pattern"),
    ({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]},
     "tools.0.function.extra", "Extra"),
    ({"tools": [WEATHER] * 3}, "tools", "max_tools"),
    ({"chat_template_kwargs": {"tools": [WEATHER]}}, "chat_template_kwargs", "set by the engine"),
])
def test_bad_tools_are_invalid_requests_naming_the_field(fields, field, words):
    with pytest.raises(ProtocolError) as exc:
        decode_job(job(**fields), Limits(max_tools=2))
    assert words in str(exc.value)
    if field is not None:
        assert exc.value.field == field


def test_tools_are_bounded_in_size_and_depth():
    deep: dict = {"type": "string"}
    for _ in range(80):
        deep = {"type": "array", "items": deep}
    nested = {"type": "function", "function": {"name": "f", "parameters": deep}}
    with pytest.raises(ProtocolError, match="max_schema_depth") as exc:
        decode_job(job(tools=[nested]))
    assert exc.value.field == "tools"
    with pytest.raises(ProtocolError, match="max_tools_bytes"):
        decode_job(job(tools=[WEATHER]), Limits(max_tools_bytes=50))


def test_the_forced_call_schema_compiles_and_accepts_only_calls_of_the_tools():
    tools = [Tool.model_validate(WEATHER),
             Tool.model_validate({"type": "function", "function": {"name": "f"}})]
    schema = call_schema(tools, parallel=True)
    StructuredOutputsParams(json=schema)
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo"}},
                         {"name": "f", "arguments": {}}], schema)
    for bad in ([], [{"name": "f", "arguments": {"x": 1}}], [{"name": "get_weather",
                                                             "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = call_schema(tools[:1], parallel=False)
    assert one["maxItems"] == 1 and one["items"]["properties"]["name"] == {"const": "get_weather"}


def test_assistant_tool_calls_are_given_to_templates_with_parsed_arguments():
    calls = template_tool_calls([{"id": "c1", "type": "function", "function": {
        "name": "f", "arguments": '{"a": [1, 2]}'}}, {"function": {"name": "g",
                                                                    "arguments": "not json"}}])
    assert calls == [{"id": "c1", "type": "function",
                      "function": {"name": "f", "arguments": {"a": [1, 2]}}},
                     {"type": "function", "function": {"name": "g", "arguments": "not json"}}]
    with pytest.raises(ValueError, match="function.name"):
        template_tool_calls([{"id": "x"}])
