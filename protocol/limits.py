"""Size limits of a job payload, and the checks that enforce them at bounded cost.

Why limits are part of the wire contract: one payload is read by every worker that takes it, and
everything in it is paid for by the jobs batched beside it (stop strings are matched every step,
metadata is echoed in every terminal event). The worker checks them in ``protocol.decode_job``
before pydantic sees the payload; the SDK applies the same ``Limits`` before it enqueues, so a
producer gets ``InvalidRequest`` instead of a job that fails later.

Every check here is linear in the payload size and never recursive: a payload is at most
``max_payload_bytes`` (checked before unpacking), and metadata depth is walked with an explicit
stack, so no input can exhaust the interpreter's stack.

This module also holds ``scan_job_id``: when msgpack itself cannot unpack a payload (nested past
its stack limit, truncated, oversized) the worker still wants the job id, to send the producer an
``error`` event instead of leaving it waiting; the scan reads only the top-level map, iteratively.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Iterable, Iterator, Optional

import msgpack
from pydantic import BaseModel, ConfigDict, Field

from tokenrelay.protocol.regex_size import expansion

MiB = 1024 * 1024


class Limits(BaseModel):
    """Per-payload bounds. Each violation is an ``invalid_request`` error naming the field.

    The one declaration of the limits: the worker's ``--max-*`` flags (and their
    ``TOKENRELAY_MAX_*`` variables) are generated from these fields, names, bounds, defaults
    and descriptions alike (worker/config.py ``LimitSettings``). A field named ``*_bytes`` is a
    size: the worker's flag also takes ``4MiB``-style values (pydantic's ``ByteSize``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_payload_bytes: int = Field(default=8 * MiB, ge=1, description="Largest job payload "
                                   "(checked before unpacking).")
    max_prompt_bytes: int = Field(default=4 * MiB, ge=1, description="Largest prompt (or sum of "
                                  "message contents), UTF-8 bytes.")
    max_prompt_token_ids: int = Field(default=1_000_000, ge=1, description="Most prompt_token_ids.")
    max_messages: int = Field(default=10_000, ge=1, description="Most chat messages.")
    max_stop_strings: int = Field(default=64, ge=0, description="Most stop strings per job.")
    max_stop_string_chars: int = Field(default=512, ge=1, description="Longest stop string.")
    max_stop_token_ids: int = Field(default=1024, ge=0,
                                    description="Most stop token ids per job.")
    max_metadata_bytes: int = Field(default=64 * 1024, ge=0,
                                    description="Largest metadata (packed).")
    max_metadata_depth: int = Field(default=32, ge=1, description="Deepest metadata nesting.")
    max_logprobs: int = Field(default=20, ge=0, description="Largest logprobs (top-k per token).")
    max_n: int = Field(default=16, ge=1, description="Largest n (sampled choices per job).")
    max_beam_width: int = Field(default=16, ge=1, description="Largest beam_width (beam search "
                                "beams per job).")
    # params.structured_outputs (protocol/structured_outputs.py): what a grammar may cost to
    # compile is bounded by its size; llguidance's own limits bound the rest.
    max_schema_bytes: int = Field(default=64 * 1024, ge=1, description="Largest JSON schema of "
                                  "params.structured_outputs (packed or UTF-8).")
    max_schema_depth: int = Field(default=64, ge=1, description="Deepest JSON schema nesting.")
    max_choices: int = Field(default=1024, ge=1,
                             description="Most strings of a choice constraint.")
    max_choice_chars: int = Field(default=1024, ge=1, description="Longest string of a choice "
                                  "constraint.")
    max_regex_chars: int = Field(default=8192, ge=1, description="Longest regex constraint (or "
                                 "JSON whitespace_pattern).")
    # (\w+\s?){1,1000} estimates 3,000,000 and fails at a worker's lexer after about a
    # kilobyte of answer; (\w+\s?){1,700} estimates 1,470,000 and runs (protocol/regex_size.py).
    max_regex_expansion: int = Field(default=2_000_000, ge=1, description="Largest estimated "
                                     "lexer size of a regex constraint, JSON whitespace_pattern "
                                     "or schema pattern: counted repetitions multiplied out, "
                                     "squared where the body can end two ways "
                                     "((\\w+\\s?){1,1000} is 3,000,000).")
    max_grammar_bytes: int = Field(default=64 * 1024, ge=1, description="Largest Lark / GBNF "
                                   "grammar constraint.")
    # tools (protocol/tools.py): rendered into the prompt by the chat template, and their
    # parameter schemas may become a constraint (the schema bounds apply to that too).
    max_tools: int = Field(default=128, ge=1, description="Most tools per chat job.")
    max_tools_bytes: int = Field(default=256 * 1024, ge=1, description="Largest tools list of a "
                                 "job (packed).")


DEFAULT_LIMITS = Limits()


class LimitExceeded(ValueError):
    """One limit violated: ``field`` is the payload's dotted field name."""

    def __init__(self, field: Optional[str], message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


def check_payload_size(size: int, limits: Limits) -> None:
    if size > limits.max_payload_bytes:
        raise LimitExceeded(None, f"payload is {size} bytes, over the limit of "
                                  f"{limits.max_payload_bytes} (max_payload_bytes)")


def check_job_limits(obj: dict, limits: Limits) -> None:
    """Raise LimitExceeded for the first limit ``obj`` (an unpacked payload) breaks.

    Fields of the wrong type are left alone: pydantic reports those with the type it wanted.
    """
    _check_prompt(obj, limits)
    params = obj.get("params")
    if isinstance(params, dict):
        _check_params(params, limits)
    for name in ("metadata", "chat_template_kwargs"):    # free-form maps, bounded alike
        value = obj.get(name)
        if isinstance(value, (dict, list)):
            check_metadata(value, limits, name)
    tools = obj.get("tools")
    if isinstance(tools, list):
        _check_tools(tools, limits)


def _over(field: str, what: str, got: int, limit: int, name: str) -> LimitExceeded:
    return LimitExceeded(field, f"{what} {got}, over the limit of {limit} ({name})")


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _check_prompt(obj: dict, limits: Limits) -> None:
    prompt = obj.get("prompt")
    if isinstance(prompt, str) and _utf8_len(prompt) > limits.max_prompt_bytes:
        raise _over("prompt", "prompt is UTF-8 bytes", _utf8_len(prompt),
                    limits.max_prompt_bytes, "max_prompt_bytes")
    ids = obj.get("prompt_token_ids")
    if isinstance(ids, list) and len(ids) > limits.max_prompt_token_ids:
        raise _over("prompt_token_ids", "token count", len(ids), limits.max_prompt_token_ids,
                    "max_prompt_token_ids")
    messages = obj.get("messages")
    if isinstance(messages, list):
        if len(messages) > limits.max_messages:
            raise _over("messages", "message count", len(messages), limits.max_messages,
                        "max_messages")
        # Messages allow extra fields (a chat template may read them): bound their nesting too.
        if container_depth(messages, stop_after=limits.max_metadata_depth) > \
                limits.max_metadata_depth:
            raise LimitExceeded("messages", f"messages are nested more than "
                                            f"{limits.max_metadata_depth} levels deep "
                                            f"(max_metadata_depth)")
        total = sum(_utf8_len(m["content"]) for m in messages
                    if isinstance(m, dict) and isinstance(m.get("content"), str))
        if total > limits.max_prompt_bytes:
            raise _over("messages", "message contents are UTF-8 bytes", total,
                        limits.max_prompt_bytes, "max_prompt_bytes")


def _check_params(params: dict, limits: Limits) -> None:
    stop = params.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if isinstance(stops, (list, tuple)):
        if len(stops) > limits.max_stop_strings:
            raise _over("params.stop", "stop string count", len(stops), limits.max_stop_strings,
                        "max_stop_strings")
        for s in stops:
            if isinstance(s, str) and len(s) > limits.max_stop_string_chars:
                raise _over("params.stop", "a stop string has characters", len(s),
                            limits.max_stop_string_chars, "max_stop_string_chars")
    ids = params.get("stop_token_ids")
    if isinstance(ids, (list, tuple)) and len(ids) > limits.max_stop_token_ids:
        raise _over("params.stop_token_ids", "count", len(ids), limits.max_stop_token_ids,
                    "max_stop_token_ids")
    for name, limit in (("logprobs", limits.max_logprobs), ("n", limits.max_n),
                        ("beam_width", limits.max_beam_width)):
        value = params.get(name)
        if type(value) is int and value > limit:
            raise _over(f"params.{name}", "value", value, limit, f"max_{name}")
    spec = params.get("structured_outputs")
    if isinstance(spec, dict):
        _check_structured(spec, limits)


_SO = "params.structured_outputs"


def _check_structured(spec: dict, limits: Limits) -> None:
    """Bound what compiling the constraint may cost: sizes before anything parses them."""
    schema = spec.get("json")
    if isinstance(schema, str):
        size = _utf8_len(schema)
        if size > limits.max_schema_bytes:
            raise _over(f"{_SO}.json", "schema is UTF-8 bytes", size, limits.max_schema_bytes,
                        "max_schema_bytes")
        schema = _json_or_none(schema, limits)
    if isinstance(schema, (dict, list)):
        _check_schema(schema, limits)
    choice = spec.get("choice")
    if isinstance(choice, list):
        if len(choice) > limits.max_choices:
            raise _over(f"{_SO}.choice", "choice count", len(choice), limits.max_choices,
                        "max_choices")
        longest = max((len(c) for c in choice if isinstance(c, str)), default=0)
        if longest > limits.max_choice_chars:
            raise _over(f"{_SO}.choice", "a choice has characters", longest,
                        limits.max_choice_chars, "max_choice_chars")
    for name in ("regex", "whitespace_pattern"):
        value = spec.get(name)
        if isinstance(value, str) and len(value) > limits.max_regex_chars:
            raise _over(f"{_SO}.{name}", f"{name} has characters", len(value),
                        limits.max_regex_chars, "max_regex_chars")
        if isinstance(value, str):
            _check_expansion(value, f"{_SO}.{name}", limits)
    grammar = spec.get("grammar")
    if isinstance(grammar, str) and _utf8_len(grammar) > limits.max_grammar_bytes:
        raise _over(f"{_SO}.grammar", "grammar is UTF-8 bytes", _utf8_len(grammar),
                    limits.max_grammar_bytes, "max_grammar_bytes")


def _check_expansion(pattern: str, field: str, limits: Limits) -> None:
    """Refuse a regex whose estimated lexer size (protocol/regex_size.py: linear in its
    length, no compile) is over ``max_regex_expansion``: the worker's lexer would give up on
    it partway through an answer, after holding its threads (issue #42)."""
    size = expansion(pattern)
    if size is not None and size > limits.max_regex_expansion:
        raise LimitExceeded(field, (
            f"regex expands to about {size:,} lexer states, over the limit of "
            f"{limits.max_regex_expansion:,} (max_regex_expansion): a counted repetition whose "
            f"body can go on or start again on the same character, like (\\w+\\s?){{1,1000}}, "
            f"makes the lexer track every count; end the body clearly (\\w+\\s, not "
            f"\\w+\\s?) or lower the count"))


def _schema_patterns(schema: Any) -> Iterator[str]:
    """Every ``pattern`` string of a schema (iteratively: depth is bounded by the limits, not
    the interpreter's stack)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                yield node["pattern"]
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _json_or_none(text: str, limits: Limits) -> Any:
    """A schema sent as a string, parsed (it is within max_schema_bytes); None when it is not
    JSON (the schema check names that). Too deep for the parser is too deep for the limit."""
    try:
        return json.loads(text)
    except RecursionError:
        raise LimitExceeded(f"{_SO}.json", f"schema is nested more than "
                                           f"{limits.max_schema_depth} levels deep "
                                           f"(max_schema_depth)") from None
    except ValueError:
        return None


def _check_schema(schema: Any, limits: Limits) -> None:
    """Depth first (iteratively), then the packed size, as for metadata."""
    field = f"{_SO}.json"
    if container_depth(schema, stop_after=limits.max_schema_depth) > limits.max_schema_depth:
        raise LimitExceeded(field, f"schema is nested more than {limits.max_schema_depth} "
                                   f"levels deep (max_schema_depth)")
    try:
        size = len(msgpack.packb(schema, use_bin_type=True))
    except (TypeError, ValueError, OverflowError) as exc:
        raise LimitExceeded(field, f"schema is not JSON-like ({exc})") from None
    if size > limits.max_schema_bytes:
        raise _over(field, "schema packs to bytes", size, limits.max_schema_bytes,
                    "max_schema_bytes")
    for pattern in _schema_patterns(schema):
        _check_expansion(pattern, field, limits)


def _check_tools(tools: list, limits: Limits) -> None:
    """Count, nesting (a tool's parameters are a JSON schema: ``max_schema_depth``, counted
    from the list), then the packed size."""
    if len(tools) > limits.max_tools:
        raise _over("tools", "tool count", len(tools), limits.max_tools, "max_tools")
    if container_depth(tools, stop_after=limits.max_schema_depth) > limits.max_schema_depth:
        raise LimitExceeded("tools", f"tools are nested more than {limits.max_schema_depth} "
                                     f"levels deep (max_schema_depth)")
    try:
        size = len(msgpack.packb(tools, use_bin_type=True))
    except (TypeError, ValueError, OverflowError) as exc:
        raise LimitExceeded("tools", f"tools are not JSON-like ({exc})") from None
    if size > limits.max_tools_bytes:
        raise _over("tools", "tools pack to bytes", size, limits.max_tools_bytes,
                    "max_tools_bytes")


def check_metadata(metadata: Any, limits: Limits, field: str = "metadata") -> None:
    """Depth first (iteratively, so a deep value cannot overflow a stack), then packed size.
    ``field`` names the free-form map checked (metadata, chat_template_kwargs)."""
    depth = container_depth(metadata, stop_after=limits.max_metadata_depth)
    if depth > limits.max_metadata_depth:
        raise LimitExceeded(field, f"{field} is nested more than "
                                   f"{limits.max_metadata_depth} levels deep "
                                   f"(max_metadata_depth)")
    try:
        size = len(msgpack.packb(metadata, use_bin_type=True))
    except (TypeError, ValueError, OverflowError) as exc:
        raise LimitExceeded(field, f"{field} is not msgpack-serializable ({exc}); use "
                                   f"plain JSON-like values") from None
    if size > limits.max_metadata_bytes:
        raise _over(field, f"{field} packs to bytes", size, limits.max_metadata_bytes,
                    "max_metadata_bytes")


def readable_metadata(value: Any, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """``value`` if it is metadata a valid job could carry (a map with string keys, within
    ``limits``), else ``{}``; never raises. An invalid payload's error event echoes only this:
    a hostile map (integer keys, deep or huge values) must not break the error event itself."""
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        return {}
    try:
        check_metadata(value, limits)
    except Exception:  # LimitExceeded, or anything a hostile value provokes
        return {}
    return value


def container_depth(value: Any, stop_after: int) -> int:
    """Nesting depth of dicts/lists/tuples in ``value`` (a scalar is 0, ``{}`` is 1), counted
    with an explicit stack; returns as soon as the depth exceeds ``stop_after``."""
    deepest = 0
    stack: list[tuple[Iterable[Any], int]] = [(_children(value), 1)] if _is_container(value) else []
    while stack:
        children, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > stop_after:
            return deepest
        for child in children:
            if _is_container(child):
                stack.append((_children(child), depth + 1))
    return deepest


def _is_container(value: Any) -> bool:
    return isinstance(value, (dict, list, tuple))


def _children(value: Any) -> Iterable[Any]:
    if isinstance(value, dict):
        return [*value.keys(), *value.values()]
    return value


# --------------------------------------------------------------------------------------------
# job id scan
# --------------------------------------------------------------------------------------------

# Fixed-size msgpack headers: first byte -> bytes to skip (header and payload together).
_FIXED = {0xc0: 1, 0xc2: 1, 0xc3: 1, 0xca: 5, 0xcb: 9, 0xcc: 2, 0xcd: 3, 0xce: 5, 0xcf: 9,
          0xd0: 2, 0xd1: 3, 0xd2: 5, 0xd3: 9, 0xd4: 3, 0xd5: 4, 0xd6: 6, 0xd7: 10, 0xd8: 18}
# Variable-length strings, binaries and extensions: first byte -> (length bytes, extra bytes).
_SIZED = {0xc4: (1, 0), 0xc5: (2, 0), 0xc6: (4, 0), 0xd9: (1, 0), 0xda: (2, 0), 0xdb: (4, 0),
          0xc7: (1, 1), 0xc8: (2, 1), 0xc9: (4, 1)}
# Array and map headers with explicit counts: first byte -> (count bytes, items per count).
_COUNTED = {0xdc: (2, 1), 0xdd: (4, 1), 0xde: (2, 2), 0xdf: (4, 2)}
_UINT = {1: struct.Struct(">B"), 2: struct.Struct(">H"), 4: struct.Struct(">I")}
SCAN_MAX_OBJECTS = 1 << 20


class _Truncated(Exception):
    pass


def _header(buf: bytes, pos: int) -> tuple[int, int]:
    """(position after this object's own bytes, number of child objects that follow)."""
    b = buf[pos]
    if b <= 0x7f or b >= 0xe0:
        return pos + 1, 0
    if b <= 0x8f:
        return pos + 1, 2 * (b & 0x0f)
    if b <= 0x9f:
        return pos + 1, b & 0x0f
    if b <= 0xbf:
        return pos + 1 + (b & 0x1f), 0
    if b in _FIXED:
        return pos + _FIXED[b], 0
    if b in _SIZED:
        width, extra = _SIZED[b]
        return pos + 1 + width + extra + _uint(buf, pos + 1, width), 0
    if b in _COUNTED:
        width, per = _COUNTED[b]
        return pos + 1 + width, per * _uint(buf, pos + 1, width)
    raise _Truncated  # 0xc1: never used by msgpack


def _uint(buf: bytes, pos: int, width: int) -> int:
    if pos + width > len(buf):
        raise _Truncated
    return _UINT[width].unpack_from(buf, pos)[0]


def _skip(buf: bytes, pos: int, budget: list[int]) -> int:
    """Position after the object at ``pos``, children included, walked without recursion."""
    pending = 1
    while pending:
        if pos >= len(buf) or budget[0] <= 0:
            raise _Truncated
        budget[0] -= 1
        pos, children = _header(buf, pos)
        pending += children - 1
    if pos > len(buf):
        raise _Truncated
    return pos


def _read_str(buf: bytes, pos: int) -> Optional[str]:
    b = buf[pos]
    if 0xa0 <= b <= 0xbf:
        start, size = pos + 1, b & 0x1f
    elif b in (0xd9, 0xda, 0xdb):
        width = _SIZED[b][0]
        start, size = pos + 1 + width, _uint(buf, pos + 1, width)
    else:
        return None
    if start + size > len(buf):
        raise _Truncated
    try:
        return buf[start:start + size].decode("utf-8")
    except UnicodeDecodeError:
        return None


def scan_job_id(buf: Any, max_objects: int = SCAN_MAX_OBJECTS) -> Optional[str]:
    """The string value of key ``"job_id"`` in a msgpack top-level map, or None.

    Reads only what it must: map keys in order, skipping values (any depth, iteratively) until
    ``job_id``; gives up after ``max_objects`` objects or on bytes that are not msgpack. The
    caller still validates the id. Never raises.
    """
    if not isinstance(buf, (bytes, bytearray, memoryview)):
        return None
    try:
        data = bytes(buf)
        if not data:
            return None
        pos, children = _header(data, 0)
        if not (0x80 <= data[0] <= 0x8f or data[0] in (0xde, 0xdf)):
            return None
        budget = [max_objects]
        for _ in range(children // 2):
            if pos >= len(data):
                return None
            key = _read_str(data, pos)
            pos = _skip(data, pos, budget)
            if key == "job_id":
                return _read_str(data, pos) if pos < len(data) else None
            pos = _skip(data, pos, budget)
    except (_Truncated, IndexError, TypeError, ValueError):
        return None
    return None
