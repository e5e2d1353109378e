"""``params.structured_outputs``: vLLM's shape, the canonical spec, the limits and the grammar
check, all through the one payload validation (``validate_job`` / ``decode_job``)."""

from __future__ import annotations

import json

import msgpack
import pytest

from tokenrelay.protocol.errors import ProtocolError
from tokenrelay.protocol.limits import Limits
from tokenrelay.protocol.sampling_params import SamplingParams
from tokenrelay.protocol.structured_outputs import (JSON_WHITESPACE, StructuredOutputsParams, close_objects,
                                         grammar_problem)
from tokenrelay.protocol.wire import decode_job, encode_job, validate_job

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}},
          "required": ["a"]}


def job(spec, **params):
    return {"v": 1, "job_id": "j1", "prompt": "hi",
            "params": {"structured_outputs": spec, **params}}


def refused(payload, limits=Limits()) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode_job(msgpack.packb(payload, use_bin_type=True), limits)
    assert info.value.code.value == "invalid_request" and info.value.job_id == "j1"
    return info.value


@pytest.mark.parametrize("spec", [{"json": SCHEMA}, {"json": json.dumps(SCHEMA)},
                                  {"json_object": True}, {"regex": "[a-z]+"},
                                  {"choice": ["yes", "no"]},
                                  {"grammar": 'start: "a" b\nb: "x" | "y"'},
                                  {"grammar": 'root ::= "yes" | "no"'},
                                  {"json": SCHEMA, "disable_any_whitespace": True},
                                  {"json_object": True, "whitespace_pattern": " ?"},
                                  {"json": SCHEMA, "disable_additional_properties": True}])
def test_each_kind_round_trips_the_wire(spec):
    req = decode_job(encode_job(validate_job(job(spec))))
    so = req.sampling_params().structured_outputs
    assert so is not None and so.kind == next(k for k in spec if not k.startswith(("dis", "wh")))
    assert so.lark_grammar()


def test_canonical_spec_is_the_cache_key():
    as_dict = StructuredOutputsParams(json=SCHEMA)
    as_text = StructuredOutputsParams(json=json.dumps(SCHEMA, indent=2))
    assert as_dict.canonical == as_text.canonical
    assert json.loads(as_dict.canonical)["whitespace"] == JSON_WHITESPACE
    # Property order is generation order: it is part of the key.
    reordered = {**SCHEMA, "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}
    assert StructuredOutputsParams(json=reordered).canonical != as_dict.canonical
    compact = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    assert compact.canonical != as_dict.canonical
    assert StructuredOutputsParams(choice=["a", "b"]).canonical == '{"kind":"choice","value":["a","b"]}'


@pytest.mark.parametrize("spec, words", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ({"json_object": False}, "must be true"),
    ({"choice": []}, "non-empty"),
    ({"choice": ["a", ""]}, "non-empty"),
    ({"json": "[1, 2]"}, "JSON object"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "a", "disable_any_whitespace": True}, "json and json_object only"),
    ({"json_object": True, "disable_any_whitespace": True, "whitespace_pattern": " "},
     "exclude each other"),
    ({"regex": "(unclosed"}, "unclosed group"),
    ({"grammar": "start: undefined_rule"}, "unknown name"),
    ({"json": {"type": "array", "uniqueItems": True}}, "Unimplemented keys"),
    ({"json": {"type": "strnig"}}, "Invalid type"),
    ({"json": {"$ref": "#/nowhere"}}, "does not exist"),
    ({"choice": "yes"}, "valid list"),
    ({"regex": 5}, "valid string"),
    ({"guided_json": {}}, "Extra inputs"),
])
def test_bad_specs_are_invalid_request_naming_the_field(spec, words):
    err = refused(job(spec))
    assert err.field.startswith("params.structured_outputs") and words in str(err)
    assert str(err).startswith("params.structured_outputs")


def test_ignore_eos_with_a_constraint_is_refused():
    err = refused(job({"choice": ["a"]}, ignore_eos=True))
    assert "ignore_eos" in str(err)
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs={"regex": "a"})


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("spec, field, limit", [
    ({"json": {"enum": ["x" * 100] * 1000}}, "params.structured_outputs.json",
     "max_schema_bytes"),
    ({"json": json.dumps({"enum": ["x" * 100] * 1000})}, "params.structured_outputs.json",
     "max_schema_bytes"),
    ({"json": _nested(40)}, "params.structured_outputs.json", "max_schema_depth"),
    ({"json": "[" * 5000 + "]" * 5000}, "params.structured_outputs.json", "max_schema_depth"),
    ({"json": '{"a":' * 10000 + '1' + '}' * 10000}, "params.structured_outputs.json",
     "max_schema_depth"),
    ({"choice": [str(i) for i in range(1025)]}, "params.structured_outputs.choice",
     "max_choices"),
    ({"choice": ["a", "b" * 1025]}, "params.structured_outputs.choice", "max_choice_chars"),
    ({"regex": "a" * 8193}, "params.structured_outputs.regex", "max_regex_chars"),
    ({"json_object": True, "whitespace_pattern": " " * 8193},
     "params.structured_outputs.whitespace_pattern", "max_regex_chars"),
    ({"grammar": "start: " + '"a" ' * 20000}, "params.structured_outputs.grammar",
     "max_grammar_bytes"),
])
def test_limits_bound_what_a_grammar_costs(spec, field, limit):
    err = refused(job(spec))
    assert err.field == field and limit in str(err)


def test_limits_are_the_workers_to_set():
    spec = {"choice": ["a", "b", "c"]}
    refused(job(spec), Limits(max_choices=2))
    validate_job(job(spec), Limits(max_choices=3))
    deep = {"json": _nested(10)}
    refused(job(deep), Limits(max_schema_depth=8))


def test_validation_is_cached_failures_included():
    bad = StructuredOutputsParams.model_construct(regex="(still unclosed")
    before = grammar_problem.cache_info().hits
    for _ in range(3):
        refused(job({"regex": "(still unclosed"}))
    assert grammar_problem.cache_info().hits >= before + 2
    assert "unclosed" in grammar_problem(bad.canonical)


def test_disable_additional_properties_closes_object_schemas_only():
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "open": {"type": "object", "additionalProperties": True},
        "list": {"type": "array", "items": {"type": "object"}}}}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]            # a map of names
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert closed["properties"]["list"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in schema                          # a copy


_PREFIX = "the quick brown fox jumps over the lazy dog " * 3


@pytest.mark.parametrize("spec, why", [
    ({"regex": "a{1000}{1000}"}, "simplify"),
    ({"regex": "a{1000}{900}"}, "simplify"),
    ({"choice": [_PREFIX + str(i) for i in range(1024)]}, "simplify"),
    # refused before any compile: a cycle of $refs with no base case (issue #40's schema check)
    ({"json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
               "$ref": "#/$defs/a"}}, "$ref cycle with no base"),
])
def test_what_a_workers_compiler_refuses_is_refused_at_submit(spec, why):
    """Issue #42: these passed the tokenizer-free check and failed only at the worker, after
    holding its compile threads; compiled and run a little against the stand-in vocabulary
    under the engine's limits (or found invalid before that), they are refused where the
    producer submits them, with a message naming the problem."""
    err = refused(job(spec))
    assert str(err).startswith("params.structured_outputs") and why in str(err)


@pytest.mark.parametrize("spec", [
    {"choice": [_PREFIX + str(i) for i in range(64)]},
    {"regex": r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}"},
    {"regex": "a{100}{10}"},
    {"json": {"type": "object", "properties": {"x": {"type": "integer"},
                                               "name": {"type": "string"}}}},
    {"json_object": True},
])
def test_ordinary_constraints_still_pass_the_probe(spec):
    StructuredOutputsParams(**spec)


def test_a_worker_leaves_the_probe_to_its_compile_threads(monkeypatch):
    """In a worker (``skip_in_this_process``) only llguidance's reading runs at admission; the
    model's own compile, on the compile threads, refuses the hostile spec there."""
    from tokenrelay.protocol import grammar_probe
    monkeypatch.setattr(grammar_probe, "_enabled", False)
    StructuredOutputsParams(regex="a{1000}{1000}")
    with pytest.raises(ValueError, match="unclosed"):
        StructuredOutputsParams(regex="(unclosed")
