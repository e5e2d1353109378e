"""Building job payloads from submit() arguments: the SDK's encoder.

Every payload is validated by the protocol's own ``validate_job`` (the worker's validation, with
the same Limits), so nothing a worker would reject is enqueued. The hot path (``submit_many`` of
100k prompt strings) validates a template once and splices each job id and prompt into it;
``tests/protocol/test_sdk_contract.py`` proves the spliced payloads decode to the very JobRequest the
validation builds. Sampling dicts are validated once per distinct dict (``ParamsCache``).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Optional

import msgpack
from pydantic import ValidationError

from tokenrelay.producer_sdk.errors import InvalidRequest
from tokenrelay.protocol.budget import DEFAULT_CONTEXT_TOKENS, completion_tokens, job_cost, text_tokens
from tokenrelay.protocol.errors import ProtocolError
from tokenrelay.protocol.keys import Keys
from tokenrelay.protocol.limits import DEFAULT_LIMITS, LimitExceeded, Limits, check_job_limits
from tokenrelay.protocol.sampling_params import SAMPLING_FIELDS, SamplingParams
from tokenrelay.protocol.wire import INPUT_FIELDS, PROTOCOL_VERSION, JobRequest, now_ms, validate_job

# The job fields, read from the model: JobRequest's fields in its order, with the model's
# defaults. The SDK fills in the version, the validated sampling ``params``, the submit time and
# the deadline (a caller gives ``deadline_s``, relative); a caller gives the others.
MODEL_DEFAULTS = {name: f.get_default(call_default_factory=True)
                  for name, f in JobRequest.model_fields.items()}
SDK_FILLED = frozenset({"v", "params", "submitted_ms", "deadline_ms"})
PAYLOAD_FIELDS = frozenset(MODEL_DEFAULTS) - SDK_FILLED
# Keyword arguments of submit() that are job fields rather than sampling fields.
JOB_FIELDS = PAYLOAD_FIELDS | {"deadline_s", "queue"}
# (field, model default, whether that default is an empty map) after ``v`` and ``job_id``
_LAYOUT = tuple((name, default, default == {}) for name, default in MODEL_DEFAULTS.items()
                if name not in ("v", "job_id"))
_PLAIN = frozenset({str, int, float, bool, list, dict})
# Job fields a bulk template cannot hold: they differ per job, or shape the Prepared itself.
PER_JOB_FIELDS = frozenset({*INPUT_FIELDS, "job_id", "queue", "routing_key"})


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused (when it was running) for a bulk step.

    Why: ``submit_many`` of 100,000 jobs makes a few objects per job that all stay alive (each
    job's ``Prepared``, its handle); the collector, triggered every 700 allocations, scans the
    growing heap again and again: 40% of the producer's CPU per job (5.0-6.0 vs 3.0-3.8 us,
    measured with ``benchmarks/submit.py``'s jobs). What these steps make is freed by reference
    counting, and a rare cycle (an exception's traceback) by the collector's next run once it is
    back on: pausing loses nothing. It is switched back on at once, also on error. Used only
    around steps that do not wait (about a tenth of a second per 100,000 jobs)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


_SCALARS = (bool, int, float)
_FLAT = frozenset({str, bool, int, float, type(None)})


def _freeze(value: Any) -> Any:
    """A hashable key equal only for equal values in the same order and of the same types.

    Order matters: a JSON schema's ``properties`` order is the order the answer's fields are
    generated in, so two schemas that differ only in it are two constraints. Types matter:
    ``True``, ``1`` and ``1.0`` compare equal in Python, but strict validation accepts one and
    refuses another. Containers are copied into the key, so a list or schema the caller
    mutates after a submit never reads as the one validated before."""
    kind = type(value)
    if kind is dict:
        return (dict, tuple((k, _freeze(v)) for k, v in value.items()))
    if kind is list or kind is tuple:
        return (list, tuple(_freeze(v) for v in value))
    if kind in _SCALARS:
        return (kind, value)
    return value


class ParamsCache:
    """Validates sampling dicts with SamplingParams, once per distinct dict (bounded cache),
    keyed by ``_freeze`` (order and types count)."""

    def __init__(self, max_entries: int = 1024, limits: Limits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self._cache: dict[Any, dict[str, Any]] = {}
        self._max = max_entries
        self._last: tuple[dict[str, Any], dict[str, Any]] = ({}, {})

    def validate(self, sampling: Mapping[str, Any]) -> dict[str, Any]:
        """Return the normalized params to send (only the fields given) or raise InvalidRequest."""
        if not sampling:
            return {}
        last_in, last_out = self._last
        # Bulk submits repeat one dict of plain values: skip even the cache key. Only scalars
        # of the very same types qualify (no container a caller could have mutated since).
        if sampling == last_in and all(type(v) is type(last_in[k]) and type(v) in _FLAT
                                       for k, v in sampling.items()):
            return last_out
        try:
            key = _freeze(dict(sampling))
            hash(key)
        except TypeError:       # an unhashable value (a model instance, a set): no caching
            return self._validate(sampling)
        out = self._cache.get(key)
        if out is None:
            out = self._validate(sampling)
            if len(self._cache) >= self._max:
                self._cache.clear()
            self._cache[key] = out
        self._last = (dict(sampling), out)
        return out

    def _validate(self, sampling: Mapping[str, Any]) -> dict[str, Any]:
        if "structured_outputs" in sampling:
            # Its limits before SamplingParams compiles it (the worker's validation checks
            # limits before the schema too): an oversized schema is refused by its size alone.
            try:
                check_job_limits({"params": dict(sampling)}, self.limits)
            except LimitExceeded as exc:
                raise InvalidRequest(str(exc), field=exc.field) from None
        unknown = sorted(set(sampling) - SAMPLING_FIELDS)
        if unknown:
            raise InvalidRequest(
                f"unknown sampling parameter {unknown[0]!r}; valid names are "
                f"{', '.join(sorted(SAMPLING_FIELDS))}", field=unknown[0])
        try:
            sp = SamplingParams.model_validate(dict(sampling))
        except ValidationError as exc:
            err = exc.errors()[0]
            name = ".".join(str(p) for p in err.get("loc", ())) or "params"
            raise InvalidRequest(f"invalid sampling parameter {name!r}: {err.get('msg')} "
                                 f"(got {err.get('input')!r:.60})", field=name) from None
        return sp.model_dump(exclude_unset=True)


class JobIds:
    """Unique job ids without a uuid4 call per job: a random per-client prefix and a counter."""

    def __init__(self) -> None:
        self._prefix = "j" + os.urandom(8).hex() + "-"
        self._count = itertools.count(1)

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._count):x}"

    def take(self, n: int) -> list[str]:
        """``n`` fresh ids at once (the bulk path: one comprehension, not a call per job)."""
        prefix, count = self._prefix, self._count
        return [f"{prefix}{next(count):x}" for _ in range(n)]


def _deadline_ms(deadline_s: Any, submitted_ms: int) -> Optional[int]:
    """The absolute deadline of a job given ``deadline_s`` seconds from its submit time."""
    if deadline_s is None:
        return None
    if isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)) \
            or not deadline_s > 0:
        raise InvalidRequest(f"deadline_s must be > 0 seconds, got {deadline_s!r}",
                             field="deadline_s")
    return submitted_ms + int(deadline_s * 1000)


def _as_dicts(messages: Any) -> Any:
    """Chat messages given as any Mapping become dicts (msgpack packs dicts only)."""
    if isinstance(messages, list) and not all(type(m) is dict for m in messages):
        return [dict(m) if isinstance(m, Mapping) else m for m in messages]
    return messages


@dataclass(slots=True)
class Prepared:
    """One job ready to enqueue: its id, lane and encoded payload; its queue, and the shard of
    that queue it goes to (set by the client at enqueue, from the queue's shard count)."""

    job_id: str
    lane: str
    payload: bytes
    stream: bool
    queue: Optional[str] = None     # another queue of the client's namespace; None: the client's
    shard: Optional[int] = None     # ``Keys.shard_of(job_id)`` of its queue, once enqueued
    routing_key: Optional[str] = None   # prefix-affinity key (producer_sdk/core/affinity.py)
    affinity: Optional[str] = None      # the worker it was routed to; None: the shared lanes
    deadline_ms: Optional[int] = None   # its start deadline (epoch ms), which readers keep too
    cost: int = 1                       # its token cost (protocol/budget.py), for the budget


class PayloadBuilder:
    """Turns submit() arguments into protocol v1 payloads.

    Every payload is checked by ``protocol.validate_job`` (the worker's own validation, limits
    included), so a producer gets InvalidRequest before enqueue for exactly what a worker would
    reject. ``build_many`` validates its template once and then only splices job ids and prompt
    strings into it (checking each prompt's size); tests/sdk prove the spliced bytes decode to the
    same JobRequest that validation builds.
    """

    def __init__(self, keys: Keys, job_ids: Optional[JobIds] = None,
                 limits: Limits = DEFAULT_LIMITS,
                 context_tokens: int = DEFAULT_CONTEXT_TOKENS,
                 producer: Optional[str] = None) -> None:
        self.keys = keys
        self.producer = producer                # the client's default ``producer`` field
        self.limits = limits
        self.context_tokens = context_tokens    # what a chat job without max_tokens may fill
        self.params = ParamsCache(limits=limits)
        self.new_id = job_ids or JobIds()

    def build(self, prompt: Optional[str] = None, *, submitted_ms: Optional[int] = None,
              **fields: Any) -> Prepared:
        """Validate and encode one job from submit() keyword arguments: job fields
        (``JOB_FIELDS``) and sampling fields (the rest). Raises InvalidRequest naming the bad
        field. ``queue`` sends it to another queue of the namespace than the client's (the
        payload is the same; only the lanes differ). ``routing_key`` asks for prefix affinity
        (the client routes the job to a worker when it enqueues it)."""
        if prompt is not None:
            fields["prompt"] = prompt
        queue = fields.pop("queue", None)
        if queue is not None:
            try:
                Keys(self.keys.namespace, queue)
            except ValueError as exc:
                raise InvalidRequest(f"queue: {exc}", field="queue") from None
        deadline_s = fields.pop("deadline_s", None)
        params = self.params.validate({k: fields[k] for k in fields.keys() - PAYLOAD_FIELDS})
        metadata = fields.get("metadata")
        if metadata and not isinstance(metadata, Mapping):
            raise InvalidRequest("metadata must be a dict", field="metadata")
        submitted = submitted_ms if submitted_ms is not None else now_ms()
        payload = self._payload(fields, params, submitted, _deadline_ms(deadline_s, submitted))
        try:
            validate_job(payload, self.limits)
        except ProtocolError as exc:
            raise InvalidRequest(str(exc), field=exc.field) from None
        try:
            raw = msgpack.packb(payload, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidRequest(f"job {payload['job_id']}: payload is not msgpack-serializable "
                                 f"({exc}); metadata values must be plain JSON-like types",
                                 field="metadata") from None
        if len(raw) > self.limits.max_payload_bytes:
            raise InvalidRequest(f"payload is {len(raw)} bytes, over the limit of "
                                 f"{self.limits.max_payload_bytes} (max_payload_bytes)")
        return Prepared(payload["job_id"], Keys.lane_for_priority(payload["priority"]), raw,
                        payload["stream"], queue, routing_key=payload.get("routing_key"),
                        deadline_ms=payload.get("deadline_ms"),
                        cost=job_cost(payload, self.context_tokens))

    def _payload(self, fields: Mapping[str, Any], params: dict[str, Any], submitted: int,
                 deadline: Optional[int]) -> dict[str, Any]:
        """The payload map, in the model's field order: what the SDK fills in, and each job
        field given (else the model's default). Left out: None where the model's default is
        None (an optional field), and an empty value where it is an empty map (metadata); a
        None given for any other field reaches validation, which names it."""
        job_id = fields.get("job_id")
        payload: dict[str, Any] = {"v": PROTOCOL_VERSION,
                                   "job_id": self.new_id() if job_id is None else job_id}
        get = fields.get
        for name, default, empty_default in _LAYOUT:
            if name == "params":
                payload[name] = params
                continue
            if name == "submitted_ms":
                value = submitted
            elif name == "deadline_ms":
                value = deadline
            else:
                value = get(name, default)
                if name == "producer" and value is None:
                    value = self.producer
            if (value is None and default is None) or (empty_default and not value):
                continue
            if name == "messages":
                value = _as_dicts(value)
            elif type(value) not in _PLAIN and isinstance(value, Mapping):
                value = dict(value)     # msgpack packs dicts only
            payload[name] = value
        return payload

    def build_many(self, requests: Iterable[Any], defaults: Mapping[str, Any],
                   submitted_ms: int) -> list[Prepared]:
        """``build_request`` for many requests. Plain prompt strings take a fast path: the
        msgpack bytes shared by every job (params, priority, ...) are packed once and each
        payload is that template with the job id and prompt spliced in."""
        template = self._template(defaults, submitted_ms)
        if template is None:
            return [self.build_request(r, defaults, submitted_ms) for r in requests]
        head, key_prompt, tail, lane, stream, deadline, completion = template
        pack = msgpack.Packer(use_bin_type=True).pack  # one per call: Packer is not thread-safe
        # A prompt of at most this many characters is within max_prompt_bytes whatever it holds
        # (4 UTF-8 bytes per character at most; the template leaves room for the id and prompt
        # header in max_payload_bytes); longer ones take the general path, which measures.
        short = min(self.limits.max_prompt_bytes,
                    self.limits.max_payload_bytes - len(head) - len(tail) - 256) // 4
        requests = requests if type(requests) is list else list(requests)
        out = []
        # Ids for every request at once (one the general path does not use is just skipped);
        # Prepared's fields positionally: keyword arguments cost a third of its construction.
        for jid, r in zip(self.new_id.take(len(requests)), requests):
            if type(r) is str and len(r) <= short:
                out.append(Prepared(jid, lane, b"".join((head, pack(jid), key_prompt, pack(r),
                                                         tail)), stream, None, None, None,
                                    None, deadline, text_tokens(r) + completion))
            else:
                out.append(self.build_request(r, defaults, submitted_ms))
        return out

    def _template(self, defaults: Mapping[str, Any], submitted_ms: int,
                  ) -> Optional[tuple[bytes, bytes, bytes, str, bool, Optional[int], int]]:
        """Constant payload parts for prompt-only requests, and the completion part of their
        cost (``job_cost`` of a prompt job is its prompt's tokens plus this), or None when
        defaults need the general path (job ids, inputs, another queue or a routing key in the
        defaults)."""
        if not PER_JOB_FIELDS.isdisjoint(defaults):
            return None
        probe = self.build("x", job_id="x", submitted_ms=submitted_ms,
                           **defaults)  # validates everything once
        fields = msgpack.unpackb(probe.payload, raw=False)
        pack = msgpack.Packer(use_bin_type=True).pack
        rest = [(k, v) for k, v in fields.items() if k not in ("v", "job_id", "prompt")]
        head = bytes([0x80 | (3 + len(rest))]) + pack("v") + pack(PROTOCOL_VERSION) + pack("job_id")
        tail = b"".join(pack(k) + pack(v) for k, v in rest)
        completion = completion_tokens(fields.get("params") or {}, 0, chat=False)
        return (head, pack("prompt"), tail, probe.lane, probe.stream, probe.deadline_ms,
                completion)

    def build_request(self, request: Any, defaults: Mapping[str, Any],
                      submitted_ms: Optional[int] = None) -> Prepared:
        """``request`` is a prompt string or a dict of submit() keyword arguments."""
        if isinstance(request, str):
            return self.build(prompt=request, submitted_ms=submitted_ms, **defaults)
        if not isinstance(request, Mapping):
            raise InvalidRequest(f"each request must be a prompt str or a dict of submit() "
                                 f"arguments, got {type(request).__name__}")
        merged = {**defaults, **request} if defaults else request
        return self.build(submitted_ms=submitted_ms, **merged)
