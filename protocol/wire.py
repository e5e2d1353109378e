"""The tokenrelay job payload (protocol v1): what a producer puts in a job stream entry, how a
worker decodes and validates it, the dead-letter record, and result events off the wire.

Payloads are msgpack maps validated with pydantic; the human description lives in
``docs/protocol.md`` and must change together with this package. Key names live in
``protocol.keys``, limits in ``protocol.limits``, the ``params`` schema in
``protocol.sampling_params``, the result events in ``protocol.events`` and the one fold of a
result stream in ``protocol.fold``.

This module imports no torch: web backends install the SDK without the engine.
"""

from __future__ import annotations

import re
import time
from typing import Any, Literal, Optional

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tokenrelay.protocol.errors import ProtocolError, describe_validation_error, first_field
from tokenrelay.protocol.events import EVENT_TYPES, Event
from tokenrelay.protocol.limits import (DEFAULT_LIMITS, LimitExceeded, Limits, check_job_limits,
                             check_payload_size, readable_metadata, scan_job_id)
from tokenrelay.protocol.sampling_params import SamplingParams
from tokenrelay.protocol.tools import Tool, check_unique_names

PROTOCOL_VERSION = 1
MAX_JOB_ID_LEN = 128
# A job's routing key (``JobRequest.routing_key``: a conversation or system-prompt id, OpenAI's
# ``prompt_cache_key``) is hashed, never stored in a key name; the bound keeps payloads small.
MAX_ROUTING_KEY_LEN = 256
# Job ids go inside a Redis Cluster hash tag ``{...}``, so braces are not allowed; whitespace and
# control characters would make keys and logs ambiguous.
_JOB_ID_RE = re.compile(r"^[^\s{}\x00-\x1f\x7f]{1,128}$")


def readable_job_id(value: Any) -> Optional[str]:
    """``value`` if it is a valid job id, else None (never raises)."""
    return value if isinstance(value, str) and _JOB_ID_RE.match(value) else None


def validate_job_id(job_id: str) -> str:
    if not isinstance(job_id, str) or not _JOB_ID_RE.match(job_id):
        raise ValueError(
            f"job_id must be 1-{MAX_JOB_ID_LEN} characters without whitespace, control characters "
            f"or braces; got {job_id!r:.60}")
    return job_id


def now_ms() -> int:
    return int(time.time() * 1000)


# A served model name (a worker's ``--served-model-name``, a job's ``model``): OpenAI's model ids
# look like "gpt-4o" or "meta-llama/Llama-3.1-8B": any visible characters.
MODEL_NAME_PATTERN = r"^[^\s\x00-\x1f\x7f]{1,256}$"

# A producer's identity (``JobRequest.producer``): the fairness unit of a worker's grammar
# compile queue (engine/compile_queue.py). Visible characters only, so it is safe in logs.
MAX_PRODUCER_LEN = 128
PRODUCER_PATTERN = rf"^[^\s\x00-\x1f\x7f]{{1,{MAX_PRODUCER_LEN}}}$"

# W3C Trace Context (https://www.w3.org/TR/trace-context/): version-trace id-parent id-flags.
TRACEPARENT_PATTERN = r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"

# What an engine itself passes to the chat template renderer: a job's template variables may
# not replace them (the engine checks the same set for LLM.chat). ``tools`` come from the job's
# own ``tools`` field (protocol/tools.py), which the worker checks its template reads.
RESERVED_CHAT_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize",
                                           "add_generation_prompt", "return_dict",
                                           "chat_template", "tools", "documents"})


# A job's input: exactly one of these fields of JobRequest is set.
INPUT_FIELDS = ("prompt", "messages", "prompt_token_ids")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str = Field(min_length=1)
    content: str


class JobRequest(BaseModel):
    """One job as carried in the ``data`` field of a job stream entry.

    Types are strict, as the protocol documents them: ``"stream": "yes"`` or ``"priority": "1"``
    are errors. ``params`` is checked against SamplingParams by ``decode_job``.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    v: Literal[1] = PROTOCOL_VERSION
    job_id: str
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(default=None, min_length=1)
    prompt_token_ids: Optional[list[int]] = Field(default=None, min_length=1)
    params: dict[str, Any] = Field(default_factory=dict)
    priority: int = Field(default=0, ge=-(2**31), lt=2**31)
    deadline_ms: Optional[int] = Field(default=None, ge=0)
    stream: bool = True
    metadata: dict[str, Any] = Field(default_factory=dict)
    submitted_ms: Optional[int] = Field(default=None, ge=0)
    chat_template_kwargs: Optional[dict[str, Any]] = None   # with messages: template variables
    traceparent: Optional[str] = Field(default=None, pattern=TRACEPARENT_PATTERN)
    # Prefix-affinity routing (producer_sdk/core/affinity.py): jobs with the same key go to the same
    # live worker, whose prefix cache holds what they share. Only producers read it.
    routing_key: Optional[str] = Field(default=None, min_length=1,
                                       max_length=MAX_ROUTING_KEY_LEN)
    # With messages: OpenAI's function tools, given to the chat template as ``tools=``
    # (protocol/tools.py). Added to v1 additively: older workers reject the unknown field.
    tools: Optional[list[Tool]] = Field(default=None, min_length=1)
    # The served model the job is for (a worker's ``--served-model-name``): a worker serving
    # another model ends the job ``invalid_request`` naming both, never answers it with the
    # wrong model (a queue's workers serve one model; this holds also across a worker's
    # restart with another model). Added to v1 additively: older workers reject the field.
    model: Optional[str] = Field(default=None, pattern=MODEL_NAME_PATTERN)
    # Who submitted the job (the gateway: its API key's fingerprint; the SDK: the client's
    # ``producer`` or submit(producer=)): a worker shares its grammar compile threads fairly
    # among producers, so one producer's backlog of slow constraints cannot delay another's
    # (issue #42). Jobs without it share one anonymous producer. Added to v1 additively:
    # older workers reject the field.
    producer: Optional[str] = Field(default=None, pattern=PRODUCER_PATTERN)

    @field_validator("job_id")
    @classmethod
    def _job_id(cls, v: str) -> str:
        return validate_job_id(v)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_vars(cls, v: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        reserved = sorted(RESERVED_CHAT_TEMPLATE_KWARGS & set(v or ()))
        if reserved:
            raise ValueError(f"{reserved} are set by the engine, not by the job")
        return v

    @field_validator("prompt_token_ids")
    @classmethod
    def _ids(cls, v: Optional[list[int]]) -> Optional[list[int]]:
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids must be non-negative")
        return v

    @model_validator(mode="after")
    def _exactly_one_input(self) -> "JobRequest":
        given = [n for n in INPUT_FIELDS if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("exactly one of prompt, messages or prompt_token_ids is required; "
                             f"got {given or 'none'}")
        if self.chat_template_kwargs is not None and self.messages is None:
            raise ValueError("chat_template_kwargs: only a job with messages has a chat template")
        if self.tools is not None:
            if self.messages is None:
                raise ValueError("tools: only a job with messages has a chat template to "
                                 "describe them")
            check_unique_names(self.tools)
        return self

    def tool_dicts(self) -> Optional[list[dict[str, Any]]]:
        """``tools`` as the plain maps a chat template reads (None when the job has none)."""
        if self.tools is None:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def sampling_params(self) -> SamplingParams:
        """The params as SamplingParams, a fresh copy per call (the worker fills in the seed).

        Cannot fail after ``decode_job``, which validated them; a JobRequest built by hand is
        validated here (pydantic's ValidationError)."""
        return SamplingParams.model_validate(self.params)


def encode_job(job: JobRequest) -> bytes:
    return msgpack.packb(job.model_dump(exclude_none=True), use_bin_type=True)


def decode_job(raw: Any, limits: Limits = DEFAULT_LIMITS) -> JobRequest:
    """Decode and validate a job entry's ``data`` field, ``params`` included.

    Raises ``ProtocolError`` and nothing else, for any input: bytes that are not msgpack (also
    nested past msgpack's depth limit), a payload over ``limits``, not a map, an unknown ``v``,
    missing, mistyped or out-of-range fields. The error carries ``job_id`` whenever the top-level
    ``job_id`` is a valid id (read by an iterative scan when msgpack fails) and ``field``, the
    dotted name its message starts with. Afterwards ``sampling_params()`` cannot fail.
    """
    job_id: Optional[str] = None
    obj: Any = None
    try:
        obj = _unpack_job(raw, limits)
        if not isinstance(obj, dict):
            raise ProtocolError(f"payload must be a msgpack map, got {type(obj).__name__}")
        job_id = readable_job_id(obj.get("job_id"))
        if obj.get("v") != PROTOCOL_VERSION or type(obj.get("v")) is not int:
            raise ProtocolError(f"unsupported protocol version v={_brief(obj.get('v'))}; this "
                                f"worker speaks v={PROTOCOL_VERSION}", field="v")
        return validate_job(obj, limits)
    except ProtocolError as exc:
        exc.job_id = exc.job_id or job_id
        exc.metadata = exc.metadata or _metadata_of(obj, limits)
        raise
    except Exception as exc:  # the contract: nothing but ProtocolError, whatever the input
        raise ProtocolError(f"payload could not be validated ({type(exc).__name__}: {exc})"[:500],
                            job_id=job_id, metadata=_metadata_of(obj, limits)) from None


def _metadata_of(obj: Any, limits: Limits) -> dict[str, Any]:
    return readable_metadata(obj.get("metadata"), limits) if isinstance(obj, dict) else {}


def _brief(value: Any) -> str:
    """A short repr that costs nothing for a huge or deep value."""
    if isinstance(value, (dict, list, tuple, set)):
        return f"<{type(value).__name__} of {len(value)}>"
    return f"{value!r:.40}"


def _unpack_job(raw: Any, limits: Limits) -> Any:
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        return raw
    try:
        check_payload_size(len(raw), limits)
    except LimitExceeded as exc:
        raise ProtocolError(str(exc), job_id=readable_job_id(scan_job_id(raw))) from None
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise ProtocolError(f"payload is not msgpack ({type(exc).__name__}: {exc})"[:500],
                            job_id=readable_job_id(scan_job_id(raw))) from None


def validate_job(obj: dict, limits: Limits = DEFAULT_LIMITS) -> JobRequest:
    """The one validation of a job payload (an unpacked map): ``limits`` first (bounded cost),
    then the schema, ``params`` included. ``decode_job`` runs it on what it unpacked; the SDK
    runs it on what it is about to send. Raises ProtocolError naming the field."""
    try:
        check_job_limits(obj, limits)
    except LimitExceeded as exc:
        raise ProtocolError(str(exc), job_id=readable_job_id(obj.get("job_id")),
                            field=exc.field) from None
    try:
        req = JobRequest.model_validate(obj)
    except ValidationError as exc:
        raise ProtocolError(describe_validation_error(exc), field=first_field(exc)) from None
    try:
        SamplingParams.model_validate(req.params)
    except ValidationError as exc:
        raise ProtocolError(describe_validation_error(exc, prefix="params"),
                            field=first_field(exc, prefix="params")) from None
    return req


# --------------------------------------------------------------------------------------------
# Dead letters
# --------------------------------------------------------------------------------------------

class DeadLetter(BaseModel):
    """One entry of ``Keys.dead``: a job the workers gave up on. Stored as flat stream fields (not
    msgpack) so ``data`` keeps the original payload bytes exactly as the producer sent them."""

    data: bytes = b""            # original payload (raw); empty when the entry had been deleted
    reason: str                  # for a person: why it was given up on
    code: str                    # an ErrorCode value
    worker_id: str
    lane: str                    # job stream key the entry came from
    entry_id: str                # its id in that stream
    job_id: str = ""             # when one could be read from the payload
    deliveries: int = 0          # delivery count when given up on (0 = unknown)
    size: int = 0                # length of the original payload in bytes (0 = unknown)
    truncated: bool = False      # ``data`` holds only the first bytes of the payload
    ts: float = Field(default_factory=time.time)

    def to_fields(self) -> dict[str, Any]:
        return {k: (v if isinstance(v, bytes) else str(int(v)) if isinstance(v, bool) else str(v))
                for k, v in self.model_dump().items()}

    @classmethod
    def from_fields(cls, fields: dict[Any, Any]) -> "DeadLetter":
        def key(k: Any) -> str:
            return k.decode() if isinstance(k, bytes) else str(k)
        obj = {key(k): v for k, v in fields.items()}
        for k, v in obj.items():
            if k != "data" and isinstance(v, bytes):
                obj[k] = v.decode("utf-8", "replace")
        return cls.model_validate(obj)


def decode_event(raw: bytes) -> Event:
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:
        raise ProtocolError(f"result event is not msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, dict) or obj.get("type") not in EVENT_TYPES:
        raise ProtocolError(f"unknown result event: {obj!r:.80}")
    return EVENT_TYPES[obj["type"]].model_validate(obj)
