"""Tools in a job: OpenAI's function tools, what a worker says its chat template does with
them, and the constraint that makes an answer a call of one of them.

A chat job may carry ``tools`` (``JobRequest.tools``): OpenAI's tool objects, handed to the
model's chat template as transformers' ``apply_chat_template(tools=...)`` hands them, so the
prompt describes the functions in the model's own format. The worker renders them and nothing
else: whether the answer is free text, a call the model chose to make, or a call forced by a
constraint is the producer's business (``producer_sdk/openai/tool_calls.py`` parses calls out of the
text; a forced call is an ordinary ``params.structured_outputs`` constraint built here).

Why tools travel in their own field rather than in ``chat_template_kwargs``: a template that
ignores ``tools`` would silently drop them, so the worker refuses a job with tools when its
template does not read them (``invalid_request`` naming ``tools``), and advertises what its
template does in its heartbeat (``tool_format``, protocol/heartbeat.py), so producers can tell
beforehand.
``tools`` stays a reserved template variable (``protocol.wire.RESERVED_CHAT_TEMPLATE_KWARGS``):
it comes from this field only.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field

# OpenAI's function names: letters, digits, underscores and dashes, at most 64.
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"

# What a worker's chat template does with ``tools``: its heartbeat's ``tool_format``
# (protocol/heartbeat.py).
HERMES = "hermes"          # renders tools; calls: <tool_call>{"name", "arguments"}</tool_call>
UNPARSED = "unparsed"      # renders tools; its call format is not one producers here parse
NO_TOOLS = "none"          # the template ignores tools
TOOL_FORMATS = (HERMES, UNPARSED, NO_TOOLS)
PARSED_FORMATS = (HERMES,)  # formats whose calls ``tool_choice: "auto"`` can read back

# The arguments of a function declared without ``parameters``: an empty object.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                 "additionalProperties": False}


class FunctionDef(BaseModel):
    """OpenAI's ``function`` of a tool."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None      # a JSON Schema of the arguments object
    strict: Optional[bool] = None

    @property
    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else NO_PARAMETERS


class Tool(BaseModel):
    """One entry of ``tools``: ``{"type": "function", "function": {...}}``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionDef


def check_unique_names(tools: Sequence[Tool]) -> None:
    """ValueError when two tools share a name (a call could not say which it means)."""
    seen: set[str] = set()
    for t in tools:
        if t.function.name in seen:
            raise ValueError(f"two tools are named {t.function.name!r}; names must be unique")
        seen.add(t.function.name)


def call_schema(tools: Sequence[Tool], parallel: bool = True) -> dict[str, Any]:
    """The JSON Schema of an answer that calls tools (``tool_choice: "required"``): an array
    of one call (or, with ``parallel``, one or more), each ``{"name": <one of the tools>,
    "arguments": <that tool's parameters>}``, ``name`` first so a reader knows which function
    it is before the arguments stream in. The key names are the Hermes format's, the one most
    chat templates describe to their models."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t.function.name},
                             "arguments": t.function.arguments_schema}} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema




def template_tool_calls(calls: Any) -> list[dict[str, Any]]:
    """An assistant message's OpenAI ``tool_calls`` as chat templates read them: each
    ``{"id", "type": "function", "function": {"name", "arguments"}}`` with ``arguments``
    parsed into a map (transformers' convention: templates write ``arguments | tojson``);
    arguments that are not a JSON object stay the string they were. ValueError for a call
    without a function name."""
    import json

    if not isinstance(calls, list):
        raise ValueError("tool_calls must be an array")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tool_calls[{i}] needs function.name")
        args: Any = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
            args = parsed if isinstance(parsed, dict) else args
        entry: dict[str, Any] = {"type": "function",
                                 "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


__all__ = ["Tool", "FunctionDef", "TOOL_NAME_PATTERN", "HERMES",
           "UNPARSED", "NO_TOOLS", "TOOL_FORMATS", "PARSED_FORMATS", "NO_PARAMETERS",
           "check_unique_names", "call_schema", "template_tool_calls"]
