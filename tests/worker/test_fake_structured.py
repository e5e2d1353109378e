"""The FakeEngine (``--model fake:``) honours structured outputs: each choice walks the
constraint's grammar deterministically (worker/fake_structured.py), so producer tests on fake
workers get answers that satisfy it; a resumed choice replays its tokens and continues exactly;
beams walk it too; a grammar the ASCII vocabulary cannot continue ends its request alone. Its
"template" renders tools visibly, or refuses them under ``tool_format`` none."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tokenrelay.engine.errors import InvalidRequestError
from tokenrelay.engine.outputs import ResumeState
from tokenrelay.engine.sampling_params import SamplingParams
from tokenrelay.worker.fake_engine import FakeEngine, fake_constrained

SCHEMAS = [
    {"type": "object", "required": ["name", "age"], "additionalProperties": False,
     "properties": {"name": {"type": "string", "minLength": 2}, "age": {"type": "integer"}}},
    {"type": "object", "required": ["tags", "ok", "kind"],
     "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                             "minItems": 2, "maxItems": 3},
                    "ok": {"type": "boolean"}, "kind": {"enum": ["a", "bb", "ccc"]},
                    "nested": {"type": "object", "properties": {"x": {"type": "number"}}}}},
]


def run(engine: FakeEngine, rid: str, prompt: str, params: dict, resume=None) -> dict:
    engine.add_request(rid, prompt, SamplingParams.model_validate(params), resume=resume)
    out: dict[int, list] = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            text, reason, err = out.get(d.index, ["", None, None])
            out[d.index] = [text + d.new_text, d.finish_reason, d.error]
    return out


@pytest.mark.parametrize("schema", SCHEMAS)
def test_every_seed_and_choice_answers_inside_the_schema(schema):
    engine = FakeEngine()
    for seed in range(5):
        out = run(engine, f"r{seed}", "prompt", {"n": 3, "temperature": 1.0, "seed": seed,
                                                "max_tokens": 200,
                                                "structured_outputs": {"json": schema}})
        for i, (text, reason, err) in out.items():
            assert reason == "stop" and err is None, text
            jsonschema.validate(json.loads(text), schema)
            assert (text, "stop") == fake_constrained("prompt", {"json": schema}, 200,
                                                      seed=seed, greedy=False, choice=i)


def test_regex_choice_grammar_and_the_cut_of_max_tokens():
    engine = FakeEngine()
    regex = r"[a-z]+@[a-z]+\.(com|org)"
    for seed in range(5):
        (text, reason, _), = run(engine, f"x{seed}", "p", {
            "seed": seed, "max_tokens": 60, "structured_outputs": {"regex": regex}}).values()
        assert reason == "stop" and re.fullmatch(regex, text), text
    (text, _, _), = run(engine, "c", "p", {"max_tokens": 9, "structured_outputs": {
        "choice": ["north", "south"]}}).values()
    assert text in ("north", "south")
    (text, reason, _), = run(engine, "cut", "p", {"max_tokens": 3, "structured_outputs": {
        "json": SCHEMAS[0]}}).values()
    assert reason == "length" and len(text) == 3 and text.startswith("{")


def test_a_resumed_choice_continues_exactly_and_beams_walk_the_constraint():
    spec = {"json": SCHEMAS[1]}
    full, _ = fake_constrained("p", spec, 200, seed=9, greedy=False)
    engine = FakeEngine()
    (rest, reason, _), = run(engine, "r", "p", {"seed": 9, "temperature": 1.0, "max_tokens": 200,
                                               "structured_outputs": spec},
                             resume=ResumeState([ord(c) for c in full[:11]], full[:11])).values()
    assert full[:11] + rest == full and reason == "stop"
    beams = run(engine, "b", "p", {"beam_width": 3, "max_tokens": 20, "temperature": 0.0,
                                  "structured_outputs": {"choice": ["one", "two", "three"]}})
    assert sorted(beams) == [0, 1, 2]
    assert all(t in ("one", "two", "three") and r == "stop" for t, r, _ in beams.values())
    with pytest.raises(InvalidRequestError, match="do not follow the constraint"):
        engine.add_request("bad", "p", SamplingParams.model_validate(
            {"structured_outputs": spec}), resume=ResumeState([ord("x")], "x"))


def test_a_grammar_the_fake_vocabulary_cannot_continue_ends_its_request_alone():
    engine = FakeEngine()
    engine.add_request("plain", "p", SamplingParams(max_tokens=5, temperature=0))
    engine.add_request("accent", "p", SamplingParams.model_validate(
        {"max_tokens": 5, "structured_outputs": {"choice": ["é"]}}))
    errors, plain = [], ""
    while engine.has_unfinished_requests():
        for d in engine.step():
            if d.error is not None:
                errors.append(d)
            elif d.request_id == "plain":
                plain += d.new_text
    assert [e.request_id for e in errors] == ["accent"] and errors[0].finished
    assert errors[0].error.code == "invalid_request"
    assert errors[0].error.message.startswith("params.structured_outputs")
    assert len(plain) == 5


def test_the_visible_template_renders_tools_or_refuses_them():
    tools = [{"type": "function", "function": {"name": "f"}},
             {"type": "function", "function": {"name": "g"}}]
    msgs = [{"role": "user", "content": "hi"}]
    assert FakeEngine().render_chat(msgs, tools=tools).startswith("<tools>f,g</tools>\n")
    assert FakeEngine().render_chat(msgs) == "<user>hi\n<assistant>"
    with pytest.raises(InvalidRequestError, match="does not render tools"):
        FakeEngine(tool_format="none").render_chat(msgs, tools=tools)
