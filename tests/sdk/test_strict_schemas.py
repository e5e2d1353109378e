"""Strict structured output (#40): with ``strict: true``, and for a forced tool call's arguments,
objects take only the properties the schema names (OpenAI's strict mode); a schema that is no
JSON Schema (llguidance refuses it, or a ``$ref`` cycle with no base) is refused before
anything is enqueued, naming the problem and the caller's field."""

from __future__ import annotations

import pytest

from tokenrelay.producer_sdk import Client, InvalidRequest
from tokenrelay.producer_sdk.openai.format import CHAT_URL, LineError, parse_request
from tokenrelay.producer_sdk.openai.structured import from_response_format, rename_error
from tokenrelay.protocol.structured_outputs import StructuredOutputsParams, ref_cycle
from tokenrelay.worker.fake_structured import FakeConstraint

pytestmark = pytest.mark.timeout(60)
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
EXTRA = '{"city": "Paris", "country": "FRANCE"}'


def accepts(spec: dict, text: str) -> bool:
    """Whether the constraint's grammar (the engine's own, over a byte vocabulary) takes
    ``text`` whole."""
    matcher = FakeConstraint.compile(StructuredOutputsParams.model_validate(spec)).matcher
    return all(matcher.consume_token(ord(c)) for c in text) and matcher.is_accepting()


def response_format(schema: dict, strict: bool) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "c", "schema": schema,
                                                   "strict": strict}}


def test_strict_json_schema_takes_only_named_properties():
    strict = from_response_format(response_format(CITY, True)).spec
    assert accepts(strict, '{"city": "Paris"}')
    assert not accepts(strict, EXTRA)
    loose = from_response_format(response_format(CITY, False)).spec
    assert accepts(loose, EXTRA)                       # non-strict: best effort, as OpenAI's
    said = {**CITY, "additionalProperties": True}      # a schema that says so keeps its word
    assert accepts(from_response_format(response_format(said, True)).spec, EXTRA)


@pytest.mark.parametrize("strict", [True, None])
def test_a_forced_tool_call_takes_only_the_named_arguments(strict):
    tool = {"type": "function", "function": {"name": "weather", "parameters": CITY,
                                             **({"strict": strict} if strict else {})}}
    req = parse_request(CHAT_URL, {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                   "tools": [tool], "tool_choice": {
                                       "type": "function", "function": {"name": "weather"}}},
                        streaming=False)
    spec = req.kwargs["structured_outputs"]
    assert accepts(spec, '{"city": "Paris"}') and not accepts(spec, EXTRA)


CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
         "$ref": "#/$defs/a"}


@pytest.mark.parametrize("schema, words", [
    (CYCLE, "$ref cycle with no base"),
    ({"$ref": "#"}, "$ref cycle with no base"),
    ({"type": "string", "minLength": "x"}, "minLength"),
    ({"type": "strin"}, "strin"),
])
@pytest.mark.parametrize("strict", [True, False])
def test_a_schema_that_is_no_json_schema_is_refused_before_enqueue(redis_server, schema, words,
                                                                    strict):
    spec = from_response_format(response_format(schema, strict))
    with Client(redis_server.url) as client:
        with pytest.raises(InvalidRequest) as err:
            client.submit("hi", structured_outputs=spec.spec)
        renamed = rename_error(err.value, spec.param)
        assert words in str(renamed) and "response_format.json_schema.schema" in str(renamed)
    assert redis_server.client().keys("tokenrelay:jobs:*") == []


def test_recursive_schemas_with_a_base_are_fine():
    tree = {"$defs": {"t": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}}}}, "$ref": "#/$defs/t"}
    assert ref_cycle(tree) == "" and StructuredOutputsParams(json=tree).kind == "json"
    assert ref_cycle({"$ref": "#/$defs/missing"}) == ""   # llguidance names a missing one
    with pytest.raises(LineError):
        from_response_format(response_format(CITY, "yes"))     # hostile strict
