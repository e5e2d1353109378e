"""Sans-IO core shared by the sync and async clients: payloads, the enqueue script, reply parsing.

Nothing here touches a socket, so ``Client`` and ``AsyncClient`` differ only in how they wait.
The hot path (``submit_many`` of 100k jobs) builds payload dicts directly and validates sampling
parameters once per distinct dict: a pydantic round trip per job would cost more than Redis does.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

import msgpack
from pydantic import ValidationError
from redis.exceptions import OutOfMemoryError, ResponseError

from producer_sdk.errors import InvalidRequest
from producer_sdk.protocol import (DEDUPE_SEPARATOR, DEFAULT_LIMITS, PAYLOAD_FIELD,
                                   PROTOCOL_VERSION, Keys, Limits, ProtocolError, now_ms,
                                   parse_dedupe_record, validate_job)
from producer_sdk.sampling_params import SAMPLING_FIELDS, SamplingParams

# Keyword arguments of submit() that are job fields rather than sampling fields.
JOB_FIELDS = frozenset({"prompt", "messages", "prompt_token_ids", "job_id", "priority",
                        "deadline_s", "stream", "metadata"})
DEFAULT_MAX_QUEUED_JOBS = 100_000

# One script call enqueues a whole chunk: per job, SET-if-absent of the dedupe record and XADD
# happen atomically, so a retried call (redis-py retries on timeouts) never enqueues twice.
# KEYS: target lane, the three lanes (depth), config hash, then one dedupe key per job.
# ARGV: explicit limit ('' = config hash or default), dedupe TTL, default limit, payloads.
# Reply: {depth when the queue filled up or -1, limit, then per accepted/known job either the new
# entry id or '=' .. the existing dedupe record}. Jobs past the reply's end were refused (full).
ENQUEUE_LUA_TEMPLATE = """
local limit = tonumber(ARGV[1])
if not limit then
  limit = tonumber(redis.call('HGET', KEYS[5], 'max_queued_jobs')) or tonumber(ARGV[3])
end
local depth = redis.call('XLEN', KEYS[2]) + redis.call('XLEN', KEYS[3]) + redis.call('XLEN', KEYS[4])
local lane = KEYS[1]
local ttl = ARGV[2]
local out = {-1, limit}
for i = 1, #KEYS - 5 do
  local dk = KEYS[5 + i]
  local cur = redis.call('GET', dk)
  if cur then
    out[#out + 1] = '=' .. cur
  else
    if limit > 0 and depth >= limit then
      out[1] = depth
      return out
    end
    local id = redis.call('XADD', lane, '*', '@FIELD@', ARGV[3 + i])
    redis.call('SET', dk, lane .. '@SEP@' .. id, 'EX', ttl)
    depth = depth + 1
    out[#out + 1] = id
  end
end
return out
"""
# The protocol's constants, not literals: the payload field and the dedupe record's separator
# (``protocol.dedupe_record`` builds and parses the same record in Python).
ENQUEUE_LUA = (ENQUEUE_LUA_TEMPLATE.replace("@FIELD@", PAYLOAD_FIELD.decode())
               .replace("@SEP@", DEDUPE_SEPARATOR))


def pack_command(args: Sequence[bytes]) -> bytes:
    """RESP-encode one command. Faster than redis-py's generic packer for 1,000-argument calls."""
    parts = [b"*%d\r\n" % len(args)]
    append = parts.append
    for a in args:
        append(b"$%d\r\n" % len(a))
        append(a)
        append(b"\r\n")
    return b"".join(parts)


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


class ParamsCache:
    """Validates sampling dicts with SamplingParams, once per distinct dict (bounded cache)."""

    def __init__(self, max_entries: int = 1024) -> None:
        self._cache: dict[Any, dict[str, Any]] = {}
        self._max = max_entries
        self._last: tuple[Any, dict[str, Any]] = (None, {})

    def validate(self, sampling: Mapping[str, Any]) -> dict[str, Any]:
        """Return the normalized params to send (only the fields given) or raise InvalidRequest."""
        if not sampling:
            return {}
        last_in, last_out = self._last
        if sampling == last_in:  # bulk submits repeat one dict: skip even the cache key
            return last_out
        out = self._lookup(sampling)
        self._last = (dict(sampling), out)
        return out

    def _lookup(self, sampling: Mapping[str, Any]) -> dict[str, Any]:
        try:
            key = _freeze(dict(sampling))
            hash(key)
        except TypeError:
            return self._validate(sampling)
        cached = self._cache.get(key)
        if cached is None:
            cached = self._validate(sampling)
            if len(self._cache) >= self._max:
                self._cache.clear()
            self._cache[key] = cached
        return cached

    @staticmethod
    def _validate(sampling: Mapping[str, Any]) -> dict[str, Any]:
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


def _as_dicts(messages: Any) -> Any:
    """Chat messages given as any Mapping become dicts (msgpack packs dicts only)."""
    if isinstance(messages, list) and not all(type(m) is dict for m in messages):
        return [dict(m) if isinstance(m, Mapping) else m for m in messages]
    return messages


@dataclass(slots=True)
class Prepared:
    """One job ready to enqueue: its id, lane and encoded payload."""

    job_id: str
    lane: str
    payload: bytes
    stream: bool


class PayloadBuilder:
    """Turns submit() arguments into protocol v1 payloads.

    Every payload is checked by ``protocol.validate_job`` (the worker's own validation, limits
    included), so a producer gets InvalidRequest before enqueue for exactly what a worker would
    reject. ``build_many`` validates its template once and then only splices job ids and prompt
    strings into it (checking each prompt's size); tests/sdk prove the spliced bytes decode to the
    same JobRequest that validation builds.
    """

    def __init__(self, keys: Keys, job_ids: Optional[JobIds] = None,
                 limits: Limits = DEFAULT_LIMITS) -> None:
        self.keys = keys
        self.limits = limits
        self.params = ParamsCache()
        self.new_id = job_ids or JobIds()

    def build(self, prompt: Optional[str] = None, messages: Any = None,
              prompt_token_ids: Any = None, *, job_id: Optional[str] = None, priority: int = 0,
              deadline_s: Optional[float] = None, stream: bool = True,
              metadata: Optional[Mapping[str, Any]] = None, submitted_ms: Optional[int] = None,
              **sampling: Any) -> Prepared:
        """Validate and encode one job. Raises InvalidRequest naming the bad field."""
        params = self.params.validate(sampling)
        payload: dict[str, Any] = {"v": PROTOCOL_VERSION,
                                   "job_id": self.new_id() if job_id is None else job_id}
        for name, value in (("prompt", prompt), ("messages", _as_dicts(messages)),
                            ("prompt_token_ids", prompt_token_ids)):
            if value is not None:
                payload[name] = value
        payload["params"] = params
        payload["priority"] = priority
        payload["stream"] = stream
        if metadata:
            if not isinstance(metadata, Mapping):
                raise InvalidRequest("metadata must be a dict", field="metadata")
            payload["metadata"] = dict(metadata)
        submitted = submitted_ms if submitted_ms is not None else now_ms()
        payload["submitted_ms"] = submitted
        if deadline_s is not None:
            if isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)) \
                    or not deadline_s > 0:
                raise InvalidRequest(f"deadline_s must be > 0 seconds, got {deadline_s!r}",
                                     field="deadline_s")
            payload["deadline_ms"] = submitted + int(deadline_s * 1000)
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
        return Prepared(payload["job_id"], Keys.lane_for_priority(priority), raw, stream)

    def build_many(self, requests: Iterable[Any], defaults: Mapping[str, Any],
                   submitted_ms: int) -> list[Prepared]:
        """``build_request`` for many requests. Plain prompt strings take a fast path: the
        msgpack bytes shared by every job (params, priority, ...) are packed once and each
        payload is that template with the job id and prompt spliced in."""
        template = self._template(defaults, submitted_ms)
        if template is None:
            return [self.build_request(r, defaults, submitted_ms) for r in requests]
        head, key_prompt, tail, lane, stream = template
        pack = msgpack.Packer(use_bin_type=True).pack  # one per call: Packer is not thread-safe
        new_id = self.new_id
        # A prompt of at most this many characters is within max_prompt_bytes whatever it holds
        # (4 UTF-8 bytes per character at most; the template leaves room for the id and prompt
        # header in max_payload_bytes); longer ones take the general path, which measures.
        short = min(self.limits.max_prompt_bytes,
                    self.limits.max_payload_bytes - len(head) - len(tail) - 256) // 4
        out = []
        for r in requests:
            if type(r) is str and len(r) <= short:
                jid = new_id()
                out.append(Prepared(jid, lane, b"".join((head, pack(jid), key_prompt, pack(r),
                                                         tail)), stream))
            else:
                out.append(self.build_request(r, defaults, submitted_ms))
        return out

    def _template(self, defaults: Mapping[str, Any],
                  submitted_ms: int) -> Optional[tuple[bytes, bytes, bytes, str, bool]]:
        """Constant payload parts for prompt-only requests, or None when defaults need the
        general path (job ids, inputs or anything unusual in the defaults)."""
        if not set(defaults) <= SAMPLING_FIELDS | {"priority", "stream", "metadata",
                                                   "deadline_s"}:
            return None
        sampling = {k: v for k, v in defaults.items() if k in SAMPLING_FIELDS}
        probe = self.build("x", job_id="x", submitted_ms=submitted_ms,
                           **{k: v for k, v in defaults.items()})  # validates everything once
        fields = msgpack.unpackb(probe.payload, raw=False)
        fields["params"] = self.params.validate(sampling)
        pack = msgpack.Packer(use_bin_type=True).pack
        rest = [(k, v) for k, v in fields.items() if k not in ("v", "job_id", "prompt")]
        head = bytes([0x80 | (3 + len(rest))]) + pack("v") + pack(PROTOCOL_VERSION) + pack("job_id")
        tail = b"".join(pack(k) + pack(v) for k, v in rest)
        return head, pack("prompt"), tail, probe.lane, probe.stream

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


@dataclass
class EnqueueOutcome:
    """What one script call said about each job of its chunk."""

    new: list[tuple[int, str]] = field(default_factory=list)        # (index, entry id)
    known: list[tuple[int, str]] = field(default_factory=list)      # (index, dedupe record)
    refused: list[int] = field(default_factory=list)                # queue full
    depth: Optional[int] = None
    limit: Optional[int] = None


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def parse_enqueue_reply(reply: Sequence[Any], indexes: Sequence[int]) -> EnqueueOutcome:
    out = EnqueueOutcome(limit=int(reply[1]))
    results = reply[2:]
    for idx, r in zip(indexes, results):
        s = _s(r)
        if s.startswith("="):
            out.known.append((idx, s[1:]))
        else:
            out.new.append((idx, s))
    if len(results) < len(indexes):
        out.refused = list(indexes[len(results):])
        out.depth = int(reply[0])
    return out


class EnqueueScript:
    """Packs chunks of prepared jobs into EVALSHA commands for the enqueue script."""

    def __init__(self, keys: Keys, sha: str, *, limit: Optional[int], ttl_s: int,
                 default_limit: int = DEFAULT_MAX_QUEUED_JOBS) -> None:
        self.keys = keys
        self.sha = sha.encode()
        self._lanes = {name: keys.lane(name).encode() for name in keys.LANES}
        self._head = [k.encode() for k in keys.lanes()] + [keys.config.encode()]
        self._limit = b"" if limit is None else str(int(limit)).encode()
        self._ttl = str(int(ttl_s)).encode()
        self._default = str(int(default_limit)).encode()

    def command(self, jobs: Sequence[Prepared]) -> bytes:
        """One EVALSHA for jobs that all go to the same lane."""
        dedupe = self.keys.dedupe
        dkeys = [dedupe(j.job_id).encode() for j in jobs]
        args = [b"EVALSHA", self.sha, b"%d" % (5 + len(jobs)), self._lanes[jobs[0].lane],
                *self._head, *dkeys, self._limit, self._ttl, self._default,
                *[j.payload for j in jobs]]
        return pack_command(args)


def chunk_by_lane(indexes: Iterable[int], jobs: Sequence[Prepared],
                  size: int) -> list[list[int]]:
    """Group job indexes into chunks of one lane each, preserving order within a lane."""
    by_lane: dict[str, list[int]] = {}
    for i in indexes:
        by_lane.setdefault(jobs[i].lane, []).append(i)
    chunks: list[list[int]] = []
    for lane in Keys.LANES:
        idx = by_lane.get(lane, [])
        chunks.extend(idx[s:s + size] for s in range(0, len(idx), size))
    return chunks


def record_location(keys: Keys, record: Any) -> tuple[str, str]:
    """(lane key, entry id) a job's dedupe record names, for an XRANGE that finds nothing when
    there is no record (or it is unreadable)."""
    if record:
        try:
            return parse_dedupe_record(record)
        except ProtocolError:
            pass
    return keys.lane("default"), "0-0"


def normalize_xread(reply: Any) -> list[tuple[str, list[tuple[bytes, dict]]]]:
    """XREAD replies as [(key, [(entry id, fields)])] for both RESP2 and RESP3 shapes."""
    if not reply:
        return []
    if isinstance(reply, dict):
        out = []
        for key, entries in reply.items():
            if entries and isinstance(entries[0], list) and entries[0] and isinstance(
                    entries[0][0], (tuple, list)):
                entries = entries[0]
            out.append((_s(key), list(entries)))
        return out
    return [(_s(key), list(entries)) for key, entries in reply]


def is_oom(reply: Any) -> bool:
    """Redis refused a write for maxmemory. Redis 7 returns the OOM error itself; Redis 6.2
    wraps it when it comes from inside a script ("Error running script ... -OOM command not
    allowed ..."), which redis-py then raises as a plain ResponseError."""
    return isinstance(reply, OutOfMemoryError) or (
        isinstance(reply, ResponseError) and "OOM command not allowed" in str(reply))


def merge_xreads(blocking: Any, follow_up: Any) -> list[tuple[str, list[tuple[bytes, dict]]]]:
    """One answer from a blocking multi-stream XREAD and the non-blocking XREAD for the same ids
    pipelined right behind it.

    Why the pair: before Redis 7.2 a blocked multi-stream XREAD is answered with only the first
    stream that got data, although a worker writes all its jobs' streams in one step; the
    follow-up runs the moment the blocking read is answered and brings the others, without a
    client round trip. Both start from the same ids, so per stream the longer list wins."""
    merged = dict(normalize_xread(blocking))
    for key, entries in normalize_xread(follow_up):
        if len(entries) > len(merged.get(key, ())):
            merged[key] = entries
    return list(merged.items())


def redact_url(url: str) -> str:
    """The URL without its password, for error messages and logs."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    creds, _, host = rest.rpartition("@")
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user + ':***@' if user else '***@'}{host}"


class EnqueuePlan:
    """Tracks which jobs of one submit call still need a script call, round after round.

    A round is a pipelined set of EVALSHA commands. Chunks refused for back-pressure (queue full
    or Redis OOM) wait for the next round; chunks that hit NOSCRIPT are resent once the script is
    loaded. Because the script dedupes by job id, resending anything is always safe.
    """

    def __init__(self, jobs: Sequence[Prepared], script: EnqueueScript, chunk_size: int) -> None:
        self.jobs = jobs
        self.script = script
        self.chunk_size = chunk_size
        self.entries: list[Optional[tuple[bool, str]]] = [None] * len(jobs)  # (known, value)
        self.todo: list[int] = list(range(len(jobs)))
        self.refused: list[int] = []
        self.depth: Optional[int] = None
        self.limit: Optional[int] = None
        self.oom = False

    def round(self) -> list[tuple[list[int], bytes]]:
        """The commands of the next round (empty when everything was answered)."""
        todo, self.todo = sorted(self.todo), []
        return [(idx, self.script.command([self.jobs[i] for i in idx]))
                for idx in chunk_by_lane(todo, self.jobs, self.chunk_size)]

    def on_reply(self, indexes: list[int], reply: Sequence[Any]) -> None:
        out = parse_enqueue_reply(reply, indexes)
        for i, entry_id in out.new:
            self.entries[i] = (False, entry_id)
        for i, record in out.known:
            self.entries[i] = (True, record)
        if out.refused:
            self.refused.extend(out.refused)
            self.depth, self.limit = out.depth, out.limit

    def resend(self, indexes: list[int]) -> None:
        self.todo.extend(indexes)

    def refuse_oom(self, indexes: list[int]) -> None:
        self.refused.extend(indexes)
        self.oom = True

    def requeue_refused(self) -> None:
        self.todo.extend(self.refused)
        self.refused = []
        self.oom = False

    def accepted(self) -> list[int]:
        return [i for i, e in enumerate(self.entries) if e is not None]
