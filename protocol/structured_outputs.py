"""Structured outputs: vLLM's ``structured_outputs`` request, its canonical spec and its grammar.

A job (``params.structured_outputs``) or an offline ``SamplingParams`` asks for output that
parses: exactly one of a JSON schema (``json``), any JSON object (``json_object``), a regular
expression (``regex``), one of a list of strings (``choice``) or a Lark / GBNF grammar
(``grammar``). This module is the one home of the request: its shape (vLLM's names), its
canonical spec string (the key of every cache: the producer's validation, the engine's
compiled grammars), the llguidance grammar built from that spec, and the check that the
grammar compiles. The engine compiles the same grammar against its tokenizer
(``engine/grammar.py``); nothing else turns a request into a grammar.

Why llguidance validates here too: a producer (the SDK, the gateway) refuses a schema with an
unsupported keyword or a regex that does not parse before it reaches a queue, and the worker's
admission refuses it again for a raw producer, both with ``invalid_request`` naming
``params.structured_outputs``. llguidance has no dependencies and needs no tokenizer for this
check, so the torch-free side can afford it; producers also run the grammar's lexer a little
against a stand-in vocabulary under the engine's limits (``grammar_probe.py``: a few ms for a
typical schema, cached), so what explodes at a worker's compile is refused at submit.

JSON is compiled with bounded whitespace (``JSON_WHITESPACE``: between two JSON tokens one
space, or a newline and up to 12 spaces or tabs of indentation) so a small model cannot pad an
answer with whitespace until ``max_tokens``; ``disable_any_whitespace`` allows none, and
``whitespace_pattern`` sets the pattern itself.
"""

from __future__ import annotations

import functools
import json as jsonlib
import warnings
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, model_validator

from tokenrelay.protocol import grammar_probe

KINDS = ("json", "json_object", "regex", "choice", "grammar")
_JSON_KINDS = ("json", "json_object")
JSON_WHITESPACE = r"(?:\x0A[\x20\x09]{0,12}|\x20?)"
_CACHE_SIZE = 512


def parser_limits() -> Any:
    """The llguidance limits every compile of a request's grammar runs under, here and in the
    engine: the lexer's initial fuel is a fifth of llguidance's default, so a regex whose
    automaton explodes (``a{1000}{1000}``) fails in tens of milliseconds instead of holding a
    compile thread for seconds. Ordinary schemas use a small fraction of it."""
    import llguidance

    return llguidance.LLParserLimits(initial_lexer_fuel=200_000, verbose_errors=False)


with warnings.catch_warnings():
    # vLLM names the schema field ``json``; it shadows BaseModel.json, a deprecated method.
    warnings.filterwarnings("ignore", message='Field name "json"')

    class StructuredOutputsParams(BaseModel):
        """One output constraint (vLLM's ``StructuredOutputsParams``); frozen, so its canonical
        spec is computed once."""

        model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

        json: Optional[Union[dict[str, Any], str]] = None
        json_object: Optional[bool] = None
        regex: Optional[str] = None
        choice: Optional[list[str]] = None
        grammar: Optional[str] = None
        # JSON only (``json`` and ``json_object``):
        disable_any_whitespace: bool = False
        disable_additional_properties: bool = False
        whitespace_pattern: Optional[str] = None

        @model_validator(mode="after")
        def _one_constraint(self) -> "StructuredOutputsParams":
            given = [k for k in KINDS if getattr(self, k) is not None]
            if len(given) != 1:
                raise ValueError(f"exactly one of {', '.join(KINDS)} is required; got "
                                 f"{given or 'none'}")
            kind = given[0]
            if kind == "json_object" and self.json_object is not True:
                raise ValueError("json_object: must be true when given")
            if kind == "choice" and (not self.choice or any(c == "" for c in self.choice)):
                raise ValueError("choice: must be a non-empty list of non-empty strings")
            options = [o for o in ("disable_any_whitespace", "disable_additional_properties")
                       if getattr(self, o)]
            options += ["whitespace_pattern"] if self.whitespace_pattern is not None else []
            if options and kind not in _JSON_KINDS:
                raise ValueError(f"{options} apply to json and json_object only, not {kind}")
            if self.disable_any_whitespace and self.whitespace_pattern is not None:
                raise ValueError("disable_any_whitespace and whitespace_pattern exclude each "
                                 "other")
            problem = grammar_problem(self.canonical, grammar_probe.enabled())
            if problem:
                raise ValueError(f"{kind}: {problem}")
            return self

        @property
        def kind(self) -> str:
            return next(k for k in KINDS if getattr(self, k) is not None)

        @functools.cached_property
        def canonical(self) -> str:
            """The spec as one string, equal for equal constraints: the cache key of compiled
            grammars. A schema given as a string is parsed (compact, key order kept: the order
            of ``properties`` is the order the answer's fields are generated in)."""
            kind = self.kind
            value: Any = getattr(self, kind)
            if kind == "json" and isinstance(value, str):
                value = _parse_schema(value)
            spec: dict[str, Any] = {"kind": kind, "value": value}
            if kind in _JSON_KINDS:
                spec["whitespace"] = ("none" if self.disable_any_whitespace
                                      else self.whitespace_pattern or JSON_WHITESPACE)
                spec["closed"] = self.disable_additional_properties
            try:
                return jsonlib.dumps(spec, separators=(",", ":"), ensure_ascii=False)
            except (RecursionError, ValueError, TypeError) as exc:
                raise ValueError(f"{kind}: cannot be serialized as JSON ({exc})") from None

        def lark_grammar(self) -> str:
            """The llguidance grammar (``grammar_of`` of the canonical spec)."""
            return grammar_of(self.canonical)


def _parse_schema(text: str) -> dict[str, Any]:
    try:
        value = jsonlib.loads(text)
    except RecursionError:
        raise ValueError("json: the schema is nested too deeply") from None
    except ValueError as exc:
        raise ValueError(f"json: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"json: a schema is a JSON object, got {type(value).__name__}")
    return value


@functools.lru_cache(maxsize=_CACHE_SIZE)
def grammar_of(canonical: str) -> str:
    """The llguidance grammar text of a canonical spec (no tokenizer: cheap, cached).
    Raises ValueError for a spec llguidance cannot even read (a GBNF grammar that does not
    convert)."""
    import llguidance

    spec = jsonlib.loads(canonical)
    kind, value = spec["kind"], spec["value"]
    if kind in _JSON_KINDS:
        schema = {"type": "object"} if kind == "json_object" else value
        if spec["closed"]:
            schema = close_objects(schema)
        ws = spec["whitespace"]
        options = ({"whitespace_flexible": False} if ws == "none"
                   else {"whitespace_flexible": True, "whitespace_pattern": ws})
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        # Each choice a Lark string literal (JSON escapes), as llguidance's own "choice" does.
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(jsonlib.dumps(c) for c in value))
    return llguidance.grammar_from("grammar", value)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def grammar_problem(canonical: str, probe: bool = True) -> str:
    """Why the spec's grammar does not compile ("" when it does), without the model's
    tokenizer: read by llguidance, then run a little against a stand-in vocabulary under the
    engine's limits (``grammar_probe``; not with ``probe`` False, in a worker). Cached, failures included: a producer sending the same
    bad schema pays once."""
    import llguidance

    spec = jsonlib.loads(canonical)
    if spec["kind"] == "json":
        cycle = ref_cycle(spec["value"])
        if cycle:
            return cycle
    try:
        grammar = grammar_of(canonical)
    except (ValueError, TypeError, RecursionError) as exc:
        return str(exc) or type(exc).__name__
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, None, limits=parser_limits())
    if is_error:
        return messages[0].strip() if messages else "the grammar does not compile"
    return grammar_probe.lexer_problem(grammar, parser_limits()) if probe else ""


# Keywords that say something about a schema without constraining values (``x-guidance``:
# llguidance's options, e.g. the lenient mode of a non-strict schema).
_ANNOTATIONS = frozenset({"title", "description", "$comment", "default", "examples",
                          "deprecated", "readOnly", "writeOnly", "$schema", "$id", "$anchor",
                          "x-guidance"})


def ref_cycle(schema: Any) -> str:
    """Why ``schema`` is not a JSON Schema llguidance would notice ("" when none is found): a
    ``$ref`` that leads back to itself through schemas that are nothing but a ``$ref`` (``a``
    is ``b``, ``b`` is ``a``): it has no base case, so no value satisfies it, yet llguidance
    compiles it. Follows local refs (``#/...``) only; the others llguidance refuses itself.
    Walks with an explicit stack: the depth is bounded by the limits, not by recursion."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            chain: list[str] = []
            cur: Any = node
            while _only_ref(cur):
                ref = cur["$ref"]
                if ref in chain:
                    loop = " -> ".join([*chain[chain.index(ref):], ref])
                    return (f"$ref cycle with no base: {loop} (each only refers to the next); "
                            f"no value satisfies it: give the cycle a schema of its own")
                chain.append(ref)
                cur = _pointer(schema, ref)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return ""


def _only_ref(node: Any) -> bool:
    return (isinstance(node, dict) and isinstance(node.get("$ref"), str)
            and node["$ref"].startswith("#") and set(node) - {"$ref"} <= _ANNOTATIONS)


def _pointer(root: Any, ref: str) -> Any:
    """The subschema a local ``$ref`` (``#/a/b``, RFC 6901 escapes) points at; None if none."""
    node = root
    for part in ref[1:].lstrip("/").split("/") if ref[1:] else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
               "unevaluatedProperties", "propertyNames")


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` in which every object schema without ``additionalProperties``
    forbids properties it does not name (vLLM's ``disable_additional_properties``). Walks the
    subschema positions only (a property named ``properties`` is not a schema), with an
    explicit stack: the depth is bounded by the limits, not by recursion."""
    root = jsonlib.loads(jsonlib.dumps(schema))
    stack = [root]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if ("properties" in node or node.get("type") == "object") \
                and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        stack.extend(node.get(key) for key in _SCHEMA_ONE)
    return root
