"""Every spelling of an output constraint a producer takes, turned into the job's one field
``params.structured_outputs``; and an OpenAI request's tools, turned into a ``ToolPlan``, the
job's ``tools`` and, for a forced call, that same constraint.

Spellings: OpenAI's ``response_format`` (``json_object``; ``json_schema`` with ``strict``),
vLLM's ``structured_outputs`` extra and its legacy ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``, ``tools`` with ``tool_choice`` ``required`` or a named
function, and the CLI's ``--json-schema`` / ``--json-object`` / ``--regex`` / ``--choice`` /
``--grammar``. Each becomes a ``Constraint``: the map, and the field as its caller wrote it.

Validation is not done here: the SDK's one payload validation (``protocol.wire.validate_job``,
limits first, then the grammar compiled by llguidance) refuses a bad constraint before it is
enqueued, naming ``params.structured_outputs``; ``rename_error`` renames that to the caller's
field (``response_format.json_schema.schema``, ``guided_regex``, ``--regex``, ...), so the
gateway's 400 and the batch runner's errors line point at what the caller must fix.

``strict``: OpenAI's strict schemas are followed exactly, and a keyword llguidance does not
support is a 400; their objects, and a forced tool call's arguments (strict or not), take only
the properties the schema names (``strict_json``: ``disable_additional_properties``). A
non-strict schema is best effort, as OpenAI's is: unsupported keywords are ignored
(llguidance's ``x-guidance.lenient``). A schema that is no JSON Schema is a 400 either way.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from pydantic import ValidationError

from tokenrelay.producer_sdk.errors import InvalidRequest, LineError
from tokenrelay.protocol.tools import HERMES, UNPARSED, Tool, call_schema, check_unique_names

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


@dataclass(frozen=True, slots=True)
class Constraint:
    """A ``structured_outputs`` map, and the field its caller wrote it in (for errors)."""

    spec: dict[str, Any]
    param: str


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's tools ask of the answer (``producer_sdk/openai/tool_calls.py`` reads it):
    ``choice`` ``auto`` (the model may call), ``required`` (a constrained array of calls) or
    ``function`` (a constrained call of ``function``)."""

    choice: str
    names: tuple[str, ...]
    function: Optional[str] = None
    parallel: bool = True            # parallel_tool_calls: False keeps the first call only


def lenient(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema followed on a best-effort basis: keywords llguidance does not support are
    ignored instead of refused (OpenAI's non-strict ``json_schema``)."""
    extra = schema.get("x-guidance")
    return {**schema, "x-guidance": {**(extra if isinstance(extra, dict) else {}),
                                     "lenient": True}}


# --------------------------------------------------------------------------------------------
# OpenAI request bodies
# --------------------------------------------------------------------------------------------

def pop_openai(chat: bool, body: dict[str, Any]
               ) -> tuple[Optional[Constraint], Optional[ToolPlan], Optional[list[dict]]]:
    """Take the constraint and tool fields out of a request body (``chat``: of
    ``/v1/chat/completions``): (the constraint, the tool plan, the job's ``tools``).
    LineError naming the field for what cannot be done."""
    given = [c for c in (from_response_format(body.pop("response_format", None)),
                         from_vllm_extras(body)) if c is not None]
    if len(given) > 1:
        raise LineError("invalid_request", f"{given[0].param} and {given[1].param} both "
                        f"constrain the answer; send one", given[1].param)
    plan, tools, forced = from_tools(chat, body)
    if forced is not None and given:
        raise LineError("invalid_request", f"tool_choice {plan.choice!r} constrains the answer "
                        f"to a tool call; it cannot also follow {given[0].param}",
                        "tool_choice")
    return (forced or (given[0] if given else None)), plan, tools


def from_response_format(value: Any) -> Optional[Constraint]:
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object``, ``json_schema``."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise LineError("invalid_request", "response_format must be an object with a type "
                        "('text', 'json_object' or 'json_schema')", "response_format")
    kind = value["type"]
    extra = sorted(set(value) - {"type", "json_schema"} if kind == "json_schema"
                   else set(value) - {"type"})
    if extra:
        raise LineError("invalid_request", f"response_format of type {kind!r} does not take "
                        f"{extra[0]!r}", f"response_format.{extra[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint({"json_object": True}, "response_format")
    if kind != "json_schema":
        raise LineError("unsupported_field", f"response_format type {kind!r} is not supported "
                        f"(text, json_object, json_schema)", "response_format.type")
    return Constraint(_json_schema(value.get("json_schema")), "response_format.json_schema.schema")


def _json_schema(spec: Any) -> dict[str, Any]:
    """The constraint of a ``json_schema`` response format: a strict schema followed exactly
    (``strict_json``), any other on a best-effort basis (``lenient``)."""
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise LineError("invalid_request", f"{where} must be an object with name and schema",
                        where)
    extra = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if extra:
        raise LineError("invalid_request", f"{where} does not take {extra[0]!r}",
                        f"{where}.{extra[0]}")
    name = spec.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= 64:
        raise LineError("invalid_request", f"{where}.name must be a string of 1-64 "
                        f"characters", f"{where}.name")
    strict = spec.get("strict")
    if strict is not None and type(strict) is not bool:
        raise LineError("invalid_request", f"{where}.strict must be a boolean",
                        f"{where}.strict")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise LineError("invalid_request", f"{where}.schema must be a JSON Schema object",
                        f"{where}.schema")
    return strict_json(schema) if strict else {"json": lenient(schema)}


def strict_json(schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's strict mode: the schema followed exactly, and every object in it takes only
    the properties it names (unless it says ``additionalProperties`` itself): a strict
    schema's answer, or a tool call's arguments, never holds a field the caller did not ask
    for."""
    return {"json": schema, "disable_additional_properties": True}


def from_vllm_extras(body: dict[str, Any]) -> Optional[Constraint]:
    """vLLM's ``structured_outputs`` map, or one of its legacy ``guided_*`` fields (with
    ``guided_whitespace_pattern``; ``guided_decoding_backend`` is accepted and ignored, as
    vLLM itself now ignores it)."""
    given: list[Constraint] = []
    spec = body.pop("structured_outputs", None)
    if spec is not None:
        if not isinstance(spec, dict):
            raise LineError("invalid_request", "structured_outputs must be an object",
                            "structured_outputs")
        given.append(Constraint(spec, "structured_outputs"))
    for name, kind in _GUIDED.items():
        value = body.pop(name, None)
        if value is not None:
            given.append(Constraint({kind: value}, name))
    pattern = body.pop("guided_whitespace_pattern", None)
    backend = body.pop("guided_decoding_backend", None)
    if backend is not None and not isinstance(backend, str):
        raise LineError("invalid_request", "guided_decoding_backend must be a string",
                        "guided_decoding_backend")
    if len(given) > 1:
        raise LineError("invalid_request", f"{given[0].param} and {given[1].param} both "
                        f"constrain the answer; send one", given[1].param)
    if pattern is not None:
        if not given or given[0].param != "guided_json":
            raise LineError("invalid_request", "guided_whitespace_pattern applies to "
                            "guided_json only", "guided_whitespace_pattern")
        given[0].spec["whitespace_pattern"] = pattern
    return given[0] if given else None


def from_tools(chat: bool, body: dict[str, Any]
               ) -> tuple[Optional[ToolPlan], Optional[list[dict]], Optional[Constraint]]:
    """``tools`` / ``tool_choice`` / ``parallel_tool_calls``: (the plan, the job's tools, the
    constraint of a forced call). ``tool_choice`` ``none`` sends no tools at all."""
    raw, choice = body.pop("tools", None), body.pop("tool_choice", None)
    parallel = body.pop("parallel_tool_calls", None)
    if parallel is not None and type(parallel) is not bool:
        raise LineError("invalid_request", "parallel_tool_calls must be a boolean",
                        "parallel_tool_calls")
    if not raw:
        if choice not in (None, "none"):
            raise LineError("invalid_request", "tool_choice needs tools", "tool_choice")
        return None, None, None
    if not chat:
        raise LineError("unsupported_field", "tools are a /v1/chat/completions field", "tools")
    tools = _tools(raw)
    names = tuple(t.function.name for t in tools)
    if choice == "none":
        return None, None, None
    plan = _plan(choice, names, parallel is not False)
    dicts = [t.model_dump(exclude_none=True) for t in tools]
    return plan, dicts, _forced_call(plan, tools)


def _tools(raw: Any) -> list[Tool]:
    if not isinstance(raw, list):
        raise LineError("invalid_request", "tools must be an array of function tools", "tools")
    out = []
    for i, t in enumerate(raw):
        try:
            out.append(Tool.model_validate(t))
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = "".join(f".{p}" for p in err.get("loc", ()))
            raise LineError("invalid_request", f"tools[{i}]{loc}: {err.get('msg')}",
                            f"tools[{i}]{loc}") from None
    try:
        check_unique_names(out)
    except ValueError as exc:
        raise LineError("invalid_request", f"tools: {exc}", "tools") from None
    return out


def _plan(choice: Any, names: tuple[str, ...], parallel: bool) -> ToolPlan:
    if choice is None or choice in ("auto", "required"):
        return ToolPlan(choice or "auto", names, None, parallel)
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(fn, dict) and isinstance(fn.get("name"), str)):
        raise LineError("invalid_request", "tool_choice must be 'none', 'auto', 'required' or "
                        "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if fn["name"] not in names:
        raise LineError("invalid_request", f"tool_choice names {fn['name']!r}, which is not "
                        f"one of the tools ({', '.join(names)})", "tool_choice.function.name")
    return ToolPlan("function", names, fn["name"], parallel)


def _forced_call(plan: ToolPlan, tools: list[Tool]) -> Optional[Constraint]:
    """The constraint of ``required`` (every tool) or a named function (that one): strict when
    every tool it covers is ``strict``, else best effort for all of them (llguidance's
    leniency is per constraint, not per subschema)."""
    if plan.choice == "auto":
        return None
    if plan.choice == "required":
        used, schema, param = tools, call_schema(tools, plan.parallel), "tools"
    else:
        i = next(i for i, t in enumerate(tools) if t.function.name == plan.function)
        used, schema = [tools[i]], tools[i].function.arguments_schema
        param = f"tools[{i}].function.parameters"
    if all(t.function.strict for t in used):
        return Constraint(strict_json(schema), param)
    # Best effort for the keywords, but never an argument the function does not take.
    return Constraint(strict_json(lenient(schema)), param)


def fit_tools(kwargs: dict[str, Any], plan: Optional[ToolPlan], tool_format: Optional[str],
              model: str, known: bool = True) -> dict[str, Any]:
    """The submit() arguments for a model whose workers advertise ``tool_format``
    (protocol/tools.py; None: not advertised, or ``known`` False: no live worker to ask).
    ``auto`` needs a format whose calls can be read back (``hermes``), and is refused (400,
    ``tool_choice``) otherwise, never silently answered without the tools; a forced call
    keeps its tools only where the template renders them (else the constraint alone carries
    the call's shape). A model nobody serves yet gets the tools as they are: its worker
    refuses them if its template cannot render them."""
    if plan is None or not known:
        return kwargs
    if plan.choice == "auto" and tool_format != HERMES:
        what = {UNPARSED: "renders tools but its tool-call format is not one read here",
                "none": "does not render tools"}.get(tool_format or "", "does not advertise "
                                                     "a tool format (an older worker?)")
        raise LineError("invalid_request", f"model {model!r} cannot take tool_choice 'auto': "
                        f"its chat template {what}. Formats read: hermes (<tool_call> JSON: "
                        f"Qwen2/2.5/3, Hermes). tool_choice 'required' or a named function "
                        f"works with any model: it constrains the answer to a call",
                        "tool_choice")
    if plan.choice != "auto" and tool_format not in (HERMES, UNPARSED):
        return {k: v for k, v in kwargs.items() if k != "tools"}
    return kwargs


# --------------------------------------------------------------------------------------------
# The CLI
# --------------------------------------------------------------------------------------------

def from_cli(json_schema: Optional[str] = None, json_object: bool = False,
             regex: Optional[str] = None, choice: Optional[list[str]] = None,
             grammar: Optional[str] = None) -> Optional[Constraint]:
    """``submit``'s constraint flags; ``--json-schema`` and ``--grammar`` take a file path or
    the text itself. InvalidRequest naming the flag for two of them, or a schema that is not
    JSON."""
    given = [(flag, v) for flag, v in (("--json-schema", json_schema),
                                       ("--json-object", json_object or None),
                                       ("--regex", regex), ("--choice", choice),
                                       ("--grammar", grammar)) if v is not None]
    if len(given) > 1:
        raise InvalidRequest(f"{given[0][0]} and {given[1][0]} both constrain the answer; "
                             f"give one", field=given[1][0])
    if not given:
        return None
    flag, value = given[0]
    if flag == "--json-schema":
        text = _file_or_text(value)
        try:
            spec: dict[str, Any] = {"json": json.loads(text)}
        except ValueError as exc:
            raise InvalidRequest(f"--json-schema: neither a readable file nor JSON ({exc})",
                                 field=flag) from None
    elif flag == "--json-object":
        spec = {"json_object": True}
    elif flag == "--grammar":
        spec = {"grammar": _file_or_text(value)}
    else:
        spec = {flag[2:]: value}
    return Constraint(spec, flag)


def _file_or_text(value: str) -> str:
    path = Path(value)
    try:
        if len(value) < 4096 and path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:
        pass
    return value


# --------------------------------------------------------------------------------------------
# Errors, named as the caller wrote the field
# --------------------------------------------------------------------------------------------

_PREFIXES = re.compile(r"^(?:invalid sampling parameter 'structured_outputs[\w.]*': |"
                       r"params\.structured_outputs[\w.]*: )?(?:Value error, )?"
                       r"(?:(?:json|json_object|regex|choice|grammar): )?")


def _detail(message: str) -> str:
    """What is wrong, without the wire's field name and pydantic's echo of the input."""
    text = _PREFIXES.sub("", message, count=1)
    cut = text.rfind(" (got ")
    return text[:cut] if cut > 0 else text


def rename_error(exc: BaseException, param: Optional[str]) -> BaseException:
    """``exc`` with the constraint named as the caller wrote it: an InvalidRequest the SDK
    raised for ``params.structured_outputs`` (``structured_outputs`` in the sampling check)
    becomes one naming ``param``; anything else is returned as it is."""
    if param is None or not isinstance(exc, InvalidRequest):
        return exc
    field = (exc.field or "").removeprefix("params.")
    if not field.startswith("structured_outputs"):
        return exc
    return InvalidRequest(f"{param}: {_detail(str(exc))}", field=param)


__all__ = ["Constraint", "ToolPlan", "pop_openai", "from_response_format", "from_vllm_extras",
           "from_tools", "fit_tools", "from_cli", "rename_error", "lenient"]
