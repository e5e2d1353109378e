"""Tool calls read back out of answers (producer_sdk/openai/tool_calls.py) and the request mapping of
tools and constraints (producer_sdk/openai/structured.py), without Redis: the reader finds the same
content and calls however the text is split into deltas (so a stream and a whole answer agree),
Hermes tags, forced JSON calls, a named function's arguments, ``parallel_tool_calls``, answers
that are not calls after all, and the constraint each ``tool_choice`` builds."""

from __future__ import annotations


import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenrelay.producer_sdk.errors import LineError
from tokenrelay.producer_sdk.openai.format import CHAT_URL, COMPLETIONS_URL, parse_request
from tokenrelay.producer_sdk.openai.structured import ToolPlan, fit_tools
from tokenrelay.producer_sdk.openai.tool_calls import CallReader, call_id, relay, whole_choice
from tokenrelay.protocol.structured_outputs import StructuredOutputsParams

AUTO = ToolPlan("auto", ("get_weather", "f"))
REQUIRED = ToolPlan("required", ("get_weather", "f"))
NAMED = ToolPlan("function", ("get_weather",), "get_weather")
HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"note": "a \\"}\\" b"}}\n</tool_call>\n<tool_call>\n{"name": "f", "arguments": {}}\n'
          '</tool_call>\n')
CASES = [
    (AUTO, HERMES, [("get_weather", '{"city": "Paris", "note": "a \\"}\\" b"}'), ("f", "{}")],
     "Let me look."),
    (AUTO, "No call: 1 < 2, <tool is not a tag.  ", [], "No call: 1 < 2, <tool is not a tag.  "),
    (AUTO, '<tool_call>\n{"arguments": {"x": [1, {"y": 2}]}, "name": "f"}\n</tool_call>',
     [("f", '{"x": [1, {"y": 2}]}')], ""),
    (AUTO, "<tool_call>\nnot json\n</tool_call> after", [], "<tool_call>\nnot json\n</tool_call> after"),
    (AUTO, 'cut <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
     [("get_weather", '{"city": "Par')], "cut"),
    (AUTO, "ends with <tool_ca", [], "ends with <tool_ca"),
    (REQUIRED, '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "f", '
               '"arguments": {}}]', [("get_weather", '{"city": "Oslo"}'), ("f", "{}")], ""),
    (ToolPlan("required", ("f",), parallel=False), '[{"name":"f","arguments":{"a":1}},'
     '{"name":"f","arguments":{"a":2}}]', [("f", '{"a":1}')], ""),
    (NAMED, '  {"city": "Oslo", "days": [1, 2]}\n ', [("get_weather", '{"city": "Oslo", '
                                                     '"days": [1, 2]}')], ""),
]


def read(plan: ToolPlan, text: str, cuts: list[int]) -> CallReader:
    reader, at = CallReader(plan), 0
    for cut in [*cuts, len(text)]:
        reader.feed(text[at:cut])
        at = cut
    reader.finish()
    return reader


@pytest.mark.parametrize("plan, text, calls, content", CASES)
def test_the_reader_finds_the_calls_and_the_content(plan, text, calls, content):
    reader = read(plan, text, [])
    assert [(c["name"], c["arguments"]) for c in reader.calls] == calls
    assert "".join(reader.content) == content


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(CASES), st.lists(st.integers(min_value=1, max_value=200), max_size=8))
def test_what_the_reader_finds_does_not_depend_on_how_the_text_was_split(case, cuts):
    plan, text, _, _ = case
    whole = read(plan, text, [])
    split = read(plan, text, sorted({c % len(text) for c in cuts} - {0}))
    assert split.calls == whole.calls and "".join(split.content) == "".join(whole.content)


def test_relayed_chunks_are_openai_tool_call_deltas_and_add_up_to_the_whole_answer():
    from openai.types.chat import ChatCompletionChunk
    from openai.types.chat.chat_completion import Choice
    reader, deltas = CallReader(AUTO), []
    pieces = [HERMES[i:i + 7] for i in range(0, len(HERMES), 7)]
    for i, piece in enumerate(pieces):
        deltas += relay(reader, "job-1", 0, piece, None, "stop" if i == len(pieces) - 1 else None)
    for d in deltas:
        ChatCompletionChunk.model_validate({"id": "x", "object": "chat.completion.chunk",
                                            "created": 1, "model": "m", "choices": [d]},
                                           strict=True)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d["delta"].get("tool_calls", []):
            if "id" in tc:
                calls[tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"],
                                      "arguments": ""}
            calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    body = whole_choice(AUTO, "job-1", 0, HERMES, None, "stop")
    Choice.model_validate(body, strict=True)
    assert [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in body["message"]["tool_calls"]] == [calls[0], calls[1]]
    assert body["message"]["content"] == "".join(d["delta"].get("content") or "" for d in deltas)
    assert calls[0]["id"] == call_id("job-1", 0, 0) != call_id("job-2", 0, 0)
    # An answer cut by max_tokens keeps its finish_reason; a forced call has no content.
    cut = whole_choice(REQUIRED, "j", 0, '[{"name": "f", "arguments": {"a', None, "length")
    assert cut["finish_reason"] == "length" and cut["message"]["content"] is None
    assert cut["message"]["tool_calls"][0]["function"]["arguments"] == '{"a'


WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string"}}}}}
NOARGS = {"type": "function", "function": {"name": "f"}}


def chat(**body):
    return parse_request(CHAT_URL, {"messages": [{"role": "user", "content": "hi"}], **body},
                         streaming=True)


def test_tool_choice_decides_the_plan_the_tools_sent_and_the_constraint():
    auto = chat(tools=[WEATHER, NOARGS])
    assert auto.tools == ToolPlan("auto", ("get_weather", "f"))
    assert auto.kwargs["tools"] == [WEATHER, NOARGS] and "structured_outputs" not in auto.kwargs
    none = chat(tools=[WEATHER], tool_choice="none")
    assert none.tools is None and "tools" not in none.kwargs
    req = chat(tools=[WEATHER, NOARGS], tool_choice="required", parallel_tool_calls=False)
    schema = req.kwargs["structured_outputs"]["json"]
    assert schema["maxItems"] == 1 and schema["x-guidance"] == {"lenient": True}  # f: not strict
    spec = StructuredOutputsParams(json=schema)                   # it compiles
    assert spec.kind == "json" and req.constraint_param == "tools"
    jsonschema.validate([{"name": "f", "arguments": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "g", "arguments": {}}], schema)
    named = chat(tools=[WEATHER, NOARGS],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.kwargs["structured_outputs"] == {"json": WEATHER["function"]["parameters"],
                                                  "disable_additional_properties": True}
    assert named.constraint_param == "tools[0].function.parameters"
    assert named.tools.function == "get_weather"


def test_messages_carry_tool_calls_and_results_as_templates_read_them():
    req = chat(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"}])
    assistant, tool = req.kwargs["messages"][1:]
    assert assistant == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}
    assert tool == {"role": "tool", "content": "42", "tool_call_id": "call_1"}


@pytest.mark.parametrize("url, body, param", [
    (COMPLETIONS_URL, {"prompt": "x", "tools": [WEATHER]}, "tools"),
    (CHAT_URL, {"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    (CHAT_URL, {"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    (CHAT_URL, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {}, "extra": 1}}}, "response_format.json_schema.extra"),
    (CHAT_URL, {"guided_whitespace_pattern": " ", "guided_regex": "a"},
     "guided_whitespace_pattern"),
    (CHAT_URL, {"messages": [{"role": "assistant", "content": None,
                              "tool_calls": [{"function": {}}]}]}, "messages[0].tool_calls"),
])
def test_tool_and_constraint_fields_are_checked_where_they_are_read(url, body, param):
    base = {"messages": [{"role": "user", "content": "hi"}]} if url == CHAT_URL else {}
    with pytest.raises(LineError) as exc:
        parse_request(url, {**base, **body}, streaming=True)
    assert exc.value.param == param


def test_tools_fit_what_the_served_model_template_does_with_them():
    kwargs = {"messages": [], "tools": [WEATHER], "structured_outputs": {"json": {}}}
    forced = ToolPlan("required", ("get_weather",))
    assert fit_tools(kwargs, forced, "hermes", "m") == kwargs
    assert fit_tools(kwargs, forced, "unparsed", "m") == kwargs
    assert "tools" not in fit_tools(kwargs, forced, "none", "m")
    assert "tools" not in fit_tools(kwargs, forced, None, "m")       # an older worker
    assert fit_tools(kwargs, AUTO, "hermes", "m") == kwargs
    assert fit_tools(kwargs, AUTO, None, "m", known=False) == kwargs  # nobody to ask yet
    for fmt, words in (("none", "does not render tools"), ("unparsed", "not one read here"),
                       (None, "older worker")):
        with pytest.raises(LineError, match=words) as exc:
            fit_tools(kwargs, AUTO, fmt, "m")
        assert exc.value.param == "tool_choice"
