"""The tokenrelay wire format (protocol v1), shared by the worker and the producer SDK.

Everything that crosses Redis is defined here and nowhere else: key names, the dedupe record,
the job payload and its limits, the result events, the one way to fold a result stream, and the
error codes. Payloads are msgpack maps validated with pydantic; the human description lives in
``docs/protocol.md`` and must change together with this module. Helpers too long to sit here live
beside it and are re-exported: ``limits`` (Limits, the job id scan), ``sampling_params``
(the ``params`` schema), ``events`` (the result event models) and ``fold`` (ResultFold).

This module imports no torch: web backends install the SDK without the engine.
"""

from __future__ import annotations

import functools
import re
import time
import zlib
from enum import Enum
from typing import Any, Literal, Optional, Union

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from producer_sdk.events import (EVENT_TYPES, TERMINAL_TYPES, DoneChoice, DoneEvent, ErrorEvent,
                                 Event,
                                 StartedEvent, Timings, TokenEvent, Usage, encode_event,
                                 is_terminal)
from producer_sdk.limits import (DEFAULT_LIMITS, LimitExceeded, Limits, check_job_limits,
                                 check_payload_size, readable_metadata, scan_job_id)
from producer_sdk.sampling_params import SamplingParams

PROTOCOL_VERSION = 1
GROUP = "workers"
PAYLOAD_FIELD = b"data"
MAX_JOB_ID_LEN = 128
# A job's routing key (``JobRequest.routing_key``: a conversation or system-prompt id, OpenAI's
# ``prompt_cache_key``) is hashed, never stored in a key name; the bound keeps payloads small.
MAX_ROUTING_KEY_LEN = 256
# Result stream entries carry the event in ``data`` and a write-batch id in ``b`` (opaque; the
# worker uses it to make retried writes idempotent). Readers ignore ``b``.
EVENT_FIELD = b"data"
BATCH_FIELD = b"b"
# Consumer name that holds jobs a draining worker handed back: it never has a heartbeat, and its
# entries are parked with an idle time of PARKED_IDLE_MS so any reclaimer takes them at once.
PARKING_CONSUMER = "__parked__"
PARKED_IDLE_MS = 10**12
# The dedupe record ``Keys.dedupe(job_id)`` holds "<lane key><DEDUPE_SEPARATOR><entry id>": the
# one entry that is this job. Lane keys and entry ids never contain a space.
DEDUPE_SEPARATOR = " "
# Job ids go inside a Redis Cluster hash tag ``{...}``, so braces are not allowed; whitespace and
# control characters would make keys and logs ambiguous.
_JOB_ID_RE = re.compile(r"^[^\s{}\x00-\x1f\x7f]{1,128}$")


class ErrorCode(str, Enum):
    """Codes of terminal ``error`` events. Clients may branch on them; messages are for people."""

    INVALID_REQUEST = "invalid_request"      # malformed payload or sampling params
    PROMPT_TOO_LONG = "prompt_too_long"      # prompt (+ max_tokens) cannot fit the model/worker
    EXPIRED = "expired"                      # deadline_ms passed before the job started
    CANCELLED = "cancelled"                  # reserved: cancellation ends with done/cancelled
    POISON = "poison"                        # delivered more than max_deliveries times
    INTERNAL = "internal"                    # engine failure that retrying will not fix
    DUPLICATE_JOB_ID = "duplicate_job_id"    # the job id names another live/known job's entry


class FinishReason(str, Enum):
    STOP = "stop"            # EOS, a stop token or a stop string
    LENGTH = "length"        # max_tokens or max_model_len reached
    CANCELLED = "cancelled"  # the producer cancelled the job


class ProtocolError(ValueError):
    """A payload that does not follow protocol v1. Carries the job id when one could be read, and
    ``field``: the dotted name of the offending field (``"params.stop"``), None for the payload
    as a whole, and ``metadata``: the payload's metadata when it is what a valid job could carry
    (the error event echoes it so clients can correlate), else ``{}``."""

    def __init__(self, message: str, job_id: Optional[str] = None,
                 code: ErrorCode = ErrorCode.INVALID_REQUEST, field: Optional[str] = None,
                 metadata: Optional[dict[str, Any]] = None) -> None:
        super().__init__(message)
        self.job_id = job_id
        self.code = code
        self.field = field
        self.metadata: dict[str, Any] = metadata or {}


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


# --------------------------------------------------------------------------------------------
# Keys
# --------------------------------------------------------------------------------------------

MAX_SHARDS = 256
CLUSTER_SLOTS = 16384


def key_slot(key: Union[str, bytes]) -> int:
    """The Redis Cluster slot of ``key`` (CRC16 of its hash tag, as the server computes it)."""
    from redis.crc import key_slot as _slot
    return _slot(key.encode() if isinstance(key, str) else key)


@functools.lru_cache(maxsize=4096)
def shard_tag(queue: str, shard: int, shards: int) -> str:
    """The hash tag (without braces) of one shard of ``queue``.

    Every key of the shard (its priority lanes, the per-worker affinity streams, its dead
    letters, and the per-job keys of the jobs enqueued there) carries ``{<tag>}``, so one Lua
    script can touch any of them in a Redis Cluster. The tag is ``<queue>:<shard>`` when that
    hashes into the middle half of the shard's equal share of the 16384 slots, else the first
    ``<queue>:<shard>~<k>`` that does: ``redis-cli --cluster create`` gives M masters M equal
    runs of slots, so the shards of a queue land on different masters whenever shards is a
    multiple of M (a plain ``{q:0}``..``{q:2}`` put two of three shards on one master). The
    search is deterministic: every producer and worker derives the same tags. A queue of one
    shard has the tag ``<queue>``."""
    if shards == 1:
        return queue
    lo = shard * CLUSTER_SLOTS // shards
    hi = (shard + 1) * CLUSTER_SLOTS // shards
    margin = (hi - lo) // 4
    k = 0
    while True:
        tag = f"{queue}:{shard}" if k == 0 else f"{queue}:{shard}~{k}"
        if lo + margin <= key_slot(tag) < hi - margin or hi - lo < 4:
            return tag
        k += 1


def shard_of_job(job_id: str, shards: int) -> int:
    """Which shard of a queue a job id goes to: producers spread jobs by id, and a job submitted
    again with the same id lands on the same shard (so the dedupe record is found)."""
    return zlib.crc32(job_id.encode()) % shards if shards > 1 else 0


class Keys:
    """Every Redis key of one namespace and queue (split into ``shards`` shards).

    A queue is ``shards`` shards (default 1). Shard ``s`` has the hash tag ``{<tag s>}``
    (``shard_tag``), and every key a Lua script touches together carries it: the priority lanes
    ``<ns>:jobs:{<tag>}`` (priority 0), ``<ns>:jobs:{<tag>}:urgent`` (< 0) and
    ``<ns>:jobs:{<tag>}:bulk`` (> 0), read most urgent first; the per-worker affinity streams
    ``<ns>:jobs:{<tag>}:w:<worker id>``; the dead letters ``<ns>:dead:{<tag>}``; and the per-job
    keys of the jobs enqueued on that shard (``<ns>:result:{<tag>}:<job id>``, ``cancel``,
    ``job`` (dedupe) and ``owner``). A job goes to shard ``shard_of_job(job_id, shards)``; who
    holds an entry knows its shard from the stream it read it from (``shard_of_stream``).
    Queue-wide keys (workers, heartbeats, config, drain, the queue set) are read by single
    commands and carry no tag. Inside a worker the engine schedules by the exact priority.
    """

    LANES = ("urgent", "default", "bulk")  # read order, most urgent first

    def __init__(self, namespace: str = "tokenrelay", queue: str = "default",
                 shards: int = 1) -> None:
        for name, value in (("namespace", namespace), ("queue", queue)):
            if not value or any(c in value for c in "{}: \t\n~"):
                raise ValueError(f"{name} must be non-empty without braces, colons, tildes or "
                                 f"whitespace; got {value!r}")
        if not isinstance(shards, int) or isinstance(shards, bool) or not 1 <= shards <= MAX_SHARDS:
            raise ValueError(f"shards must be an integer from 1 to {MAX_SHARDS}; got {shards!r}")
        self.namespace = namespace
        self.queue = queue
        self.shards = shards
        self._tags = [shard_tag(queue, s, shards) for s in range(shards)]
        self._stream_shard = {self.lane(n, s): s for s in range(shards) for n in self.LANES}

    def with_queue(self, queue: str, shards: Optional[int] = None) -> "Keys":
        """The keys of another queue of the same namespace."""
        return Keys(self.namespace, queue, self.shards if shards is None else shards)

    # -- shards
    def tag(self, shard: int) -> str:
        """``{<tag>}`` of a shard, braces included."""
        return "{" + self._tags[shard] + "}"

    def shard_of(self, job_id: str) -> int:
        return shard_of_job(job_id, self.shards)

    def shard_of_stream(self, key: str) -> int:
        """The shard of a lane or affinity stream key of this queue (KeyError otherwise)."""
        found = self._stream_shard.get(key)
        if found is not None:
            return found
        for s in range(self.shards):
            if key.startswith(f"{self.namespace}:jobs:{self.tag(s)}:w:"):
                return s
        raise KeyError(f"{key!r} is no stream of queue {self.queue!r} ({self.shards} shards)")

    def _job_shard(self, job_id: str, shard: Optional[int]) -> int:
        return self.shard_of(job_id) if shard is None else shard

    # -- queue-level keys
    def lane(self, name: str, shard: int = 0) -> str:
        base = f"{self.namespace}:jobs:{self.tag(shard)}"
        if name == "default":
            return base
        if name in ("urgent", "bulk"):
            return f"{base}:{name}"
        raise ValueError(f"unknown lane {name!r}; lanes are {self.LANES}")

    @staticmethod
    def lane_for_priority(priority: int) -> str:
        return "urgent" if priority < 0 else ("default" if priority == 0 else "bulk")

    def jobs_stream(self, priority: int = 0, shard: int = 0) -> str:
        return self.lane(self.lane_for_priority(priority), shard)

    def lanes(self, shard: Optional[int] = None) -> list[str]:
        """Job stream keys in read order, most urgent first: of one shard, or (None) of every
        shard, shard by shard."""
        shards = range(self.shards) if shard is None else (shard,)
        return [self.lane(n, s) for s in shards for n in self.LANES]

    def affinity(self, worker_id: str, shard: int) -> str:
        """One worker's own stream on a shard: jobs routed to it by their routing key (read
        beside the shared lanes, in the same consumer group)."""
        return f"{self.namespace}:jobs:{self.tag(shard)}:w:{worker_id}"

    def dead(self, shard: int = 0) -> str:
        """Dead letters of one shard (the dead-letter script writes them beside the job's keys)."""
        return f"{self.namespace}:dead:{self.tag(shard)}"

    def dead_streams(self) -> list[str]:
        return [self.dead(s) for s in range(self.shards)]

    @property
    def workers(self) -> str:
        """Sorted set: worker id -> epoch ms of its last heartbeat."""
        return f"{self.namespace}:workers:{self.queue}"

    @property
    def config(self) -> str:
        """Hash of queue settings shared by all producers and workers (``max_queued_jobs``,
        ``shards``)."""
        return f"{self.namespace}:config:{self.queue}"

    def heartbeat(self, worker_id: str) -> str:
        return f"{self.namespace}:worker:{worker_id}"

    @property
    def queues(self) -> str:
        """Set of the namespace's queue names that workers serve (each worker adds its queue at
        every heartbeat): producers find every queue's workers without scanning the keyspace
        (``producer_sdk.models``). Never pruned; a queue without live workers is just empty."""
        return f"{self.namespace}:queues"

    def drain(self, worker_id: str) -> str:
        """Drain request for one worker (set by ``worker admin drain``, with a TTL): while it
        exists the worker drains as on SIGTERM, then exits 0."""
        return f"{self.namespace}:drain:{self.queue}:{worker_id}"

    # -- per-job keys (in the slot of the job's shard; shard None: where the job id goes)
    def results(self, job_id: str, shard: Optional[int] = None) -> str:
        return f"{self.namespace}:result:{self.tag(self._job_shard(job_id, shard))}:{job_id}"

    def cancel(self, job_id: str, shard: Optional[int] = None) -> str:
        return f"{self.namespace}:cancel:{self.tag(self._job_shard(job_id, shard))}:{job_id}"

    def dedupe(self, job_id: str, shard: Optional[int] = None) -> str:
        """Set with the XADD: holds ``dedupe_record(lane key, entry id)``; its presence means
        'job known', and its value names the one entry that is this job."""
        return f"{self.namespace}:job:{self.tag(self._job_shard(job_id, shard))}:{job_id}"

    def owner(self, job_id: str, shard: Optional[int] = None) -> str:
        """Fencing record: which worker currently owns the job (written by workers only)."""
        return f"{self.namespace}:owner:{self.tag(self._job_shard(job_id, shard))}:{job_id}"


def dedupe_record(lane_key: str, entry_id: str) -> str:
    """The value of ``Keys.dedupe(job_id)``: which entry of which lane is this job."""
    return f"{lane_key}{DEDUPE_SEPARATOR}{entry_id}"


def parse_dedupe_record(value: Union[str, bytes]) -> tuple[str, str]:
    """(lane key, entry id) of a dedupe record; ProtocolError when it is not one."""
    text = value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else value
    lane, sep, entry_id = text.partition(DEDUPE_SEPARATOR) if isinstance(text, str) else ("", "", "")
    if not sep or not lane or not entry_id:
        raise ProtocolError(f"not a dedupe record (want '<lane key> <entry id>'): {value!r:.80}")
    return lane, entry_id


# --------------------------------------------------------------------------------------------
# Job payload
# --------------------------------------------------------------------------------------------

# W3C Trace Context (https://www.w3.org/TR/trace-context/): version-trace id-parent id-flags.
TRACEPARENT_PATTERN = r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"

# What an engine itself passes to the chat template renderer: a job's template variables may
# not replace them (the engine checks the same set for LLM.chat).
RESERVED_CHAT_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize",
                                           "add_generation_prompt", "return_dict",
                                           "chat_template", "tools", "documents"})


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
    # Prefix-affinity routing (producer_sdk/affinity.py): jobs with the same key go to the same
    # live worker, whose prefix cache holds what they share. Only producers read it.
    routing_key: Optional[str] = Field(default=None, min_length=1,
                                       max_length=MAX_ROUTING_KEY_LEN)

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
        given = [n for n in ("prompt", "messages", "prompt_token_ids") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("exactly one of prompt, messages or prompt_token_ids is required; "
                             f"got {given or 'none'}")
        if self.chat_template_kwargs is not None and self.messages is None:
            raise ValueError("chat_template_kwargs: only a job with messages has a chat template")
        return self

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
        raise ProtocolError(describe_validation_error(exc), field=_first_field(exc)) from None
    try:
        SamplingParams.model_validate(req.params)
    except ValidationError as exc:
        raise ProtocolError(describe_validation_error(exc, prefix="params"),
                            field=_first_field(exc, prefix="params")) from None
    return req


def _first_field(exc: ValidationError, prefix: str = "") -> Optional[str]:
    loc = [str(p) for p in (exc.errors()[0].get("loc", ()) if exc.errors() else ())]
    name = ".".join([prefix, *loc] if prefix else loc)
    return name or None


def describe_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """One line naming each bad field (dotted, under ``prefix``), for messages a person reads."""
    parts = []
    errors = exc.errors()
    for err in errors[:_MAX_DESCRIBED]:
        loc = ".".join([prefix, *map(str, err.get("loc", ()))] if prefix else
                       map(str, err.get("loc", ()))) or "payload"
        parts.append(f"{loc}: {err.get('msg')}")
    if len(errors) > _MAX_DESCRIBED:
        parts.append(f"and {len(errors) - _MAX_DESCRIBED} more errors")
    return "; ".join(parts)


_MAX_DESCRIBED = 5  # a list of a million bad token ids must not make a million-part message


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


def __getattr__(name: str) -> Any:
    """``ResultFold`` lives in ``producer_sdk.fold`` (it imports this module, so it is loaded
    on first use)."""
    if name in ("ResultFold", "Delta"):
        from producer_sdk import fold
        return getattr(fold, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "PROTOCOL_VERSION", "GROUP", "PAYLOAD_FIELD", "EVENT_FIELD", "BATCH_FIELD", "MAX_JOB_ID_LEN",
    "MAX_ROUTING_KEY_LEN",
    "PARKING_CONSUMER", "PARKED_IDLE_MS", "MAX_SHARDS", "key_slot", "shard_tag", "shard_of_job", "DEDUPE_SEPARATOR", "ErrorCode", "FinishReason",
    "ProtocolError", "readable_job_id", "readable_metadata", "validate_job_id", "now_ms", "Keys",
    "dedupe_record", "parse_dedupe_record", "Limits", "DEFAULT_LIMITS", "scan_job_id",
    "ChatMessage", "JobRequest", "encode_job", "decode_job", "validate_job",
    "describe_validation_error", "StartedEvent", "TokenEvent", "Usage", "Timings", "DoneEvent",
    "DoneChoice",
    "ErrorEvent", "Event", "EVENT_TYPES", "TERMINAL_TYPES", "encode_event", "decode_event",
    "is_terminal", "DeadLetter", "ResultFold", "Delta", "RESERVED_CHAT_TEMPLATE_KWARGS",
]
