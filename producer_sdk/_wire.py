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

from engine.sampling_params import SamplingParams
from producer_sdk.errors import InvalidRequest
from producer_sdk.protocol import PROTOCOL_VERSION, Keys, now_ms, validate_job_id

SAMPLING_FIELDS = frozenset(SamplingParams.model_fields)
# Keyword arguments of submit() that are job fields rather than sampling fields.
JOB_FIELDS = frozenset({"prompt", "messages", "prompt_token_ids", "job_id", "priority",
                        "deadline_s", "stream", "metadata"})
DEFAULT_MAX_QUEUED_JOBS = 100_000
LANE_INDEX = {"urgent": 0, "default": 1, "bulk": 2}

# One script call enqueues a whole chunk: per job, SET-if-absent of the dedupe record and XADD
# happen atomically, so a retried call (redis-py retries on timeouts) never enqueues twice.
# KEYS: target lane, the three lanes (depth), config hash, then one dedupe key per job.
# ARGV: explicit limit ('' = config hash or default), dedupe TTL, default limit, payloads.
# Reply: {depth when the queue filled up or -1, limit, then per accepted/known job either the new
# entry id or '=' .. the existing dedupe record}. Jobs past the reply's end were refused (full).
ENQUEUE_LUA = """
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
    local id = redis.call('XADD', lane, '*', 'data', ARGV[3 + i])
    redis.call('SET', dk, lane .. ' ' .. id, 'EX', ttl)
    depth = depth + 1
    out[#out + 1] = id
  end
end
return out
"""


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


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {'role', 'content'} dicts",
                             field="messages")
    for i, m in enumerate(messages):
        if (not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not m.get("role")
                or not isinstance(m.get("content"), str)):
            raise InvalidRequest(f"messages[{i}] must be a dict with a non-empty string 'role' and "
                                 f"a string 'content'; got {m!r:.80}", field="messages")
    return messages if all(type(m) is dict for m in messages) else [dict(m) for m in messages]


def _check_token_ids(ids: Any) -> list[int]:
    if (not isinstance(ids, list) or not ids
            or any(type(t) is not int or t < 0 for t in ids)):
        raise InvalidRequest("prompt_token_ids must be a non-empty list of non-negative ints",
                             field="prompt_token_ids")
    return ids


@dataclass(slots=True)
class Prepared:
    """One job ready to enqueue: its id, lane and encoded payload."""

    job_id: str
    lane: str
    payload: bytes
    stream: bool


class PayloadBuilder:
    """Turns submit() arguments into protocol v1 JobRequest payloads without pydantic per job."""

    def __init__(self, keys: Keys, job_ids: Optional[JobIds] = None) -> None:
        self.keys = keys
        self.params = ParamsCache()
        self.new_id = job_ids or JobIds()

    def build(self, prompt: Optional[str] = None, messages: Any = None,
              prompt_token_ids: Any = None, *, job_id: Optional[str] = None, priority: int = 0,
              deadline_s: Optional[float] = None, stream: bool = True,
              metadata: Optional[Mapping[str, Any]] = None, submitted_ms: Optional[int] = None,
              **sampling: Any) -> Prepared:
        """Validate and encode one job. Raises InvalidRequest naming the bad field."""
        params = self.params.validate(sampling)
        if job_id is None:
            job_id = self.new_id()
        else:
            try:
                validate_job_id(job_id)
            except ValueError as exc:
                raise InvalidRequest(str(exc), field="job_id") from None
        payload: dict[str, Any] = {"v": PROTOCOL_VERSION, "job_id": job_id}
        given = 0
        if prompt is not None:
            if not isinstance(prompt, str):
                raise InvalidRequest(f"prompt must be a str, got {type(prompt).__name__}",
                                     field="prompt")
            payload["prompt"] = prompt
            given += 1
        if messages is not None:
            payload["messages"] = _check_messages(messages)
            given += 1
        if prompt_token_ids is not None:
            payload["prompt_token_ids"] = _check_token_ids(prompt_token_ids)
            given += 1
        if given != 1:
            raise InvalidRequest("exactly one of prompt, messages or prompt_token_ids is required",
                                 field="prompt")
        if type(priority) is not int or not -(2**31) <= priority < 2**31:
            raise InvalidRequest(f"priority must be an int32, got {priority!r}", field="priority")
        payload["params"] = params
        payload["priority"] = priority
        payload["stream"] = bool(stream)
        if metadata:
            if not isinstance(metadata, Mapping):
                raise InvalidRequest("metadata must be a dict", field="metadata")
            payload["metadata"] = dict(metadata)
        submitted = submitted_ms if submitted_ms is not None else now_ms()
        payload["submitted_ms"] = submitted
        if deadline_s is not None:
            if not deadline_s > 0:
                raise InvalidRequest(f"deadline_s must be > 0 seconds, got {deadline_s!r}",
                                     field="deadline_s")
            payload["deadline_ms"] = submitted + int(deadline_s * 1000)
        try:
            raw = msgpack.packb(payload, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidRequest(f"job {job_id}: payload is not msgpack-serializable ({exc}); "
                                 f"metadata values must be plain JSON-like types",
                                 field="metadata") from None
        lane = "urgent" if priority < 0 else ("default" if priority == 0 else "bulk")
        return Prepared(job_id, lane, raw, bool(stream))

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
        out = []
        for r in requests:
            if type(r) is str:
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
        lanes = keys.lanes()
        self._lanes = {name: lanes[i].encode() for name, i in LANE_INDEX.items()}
        self._head = [k.encode() for k in lanes] + [keys.config.encode()]
        self._limit = b"" if limit is None else str(int(limit)).encode()
        self._ttl = str(int(ttl_s)).encode()
        self._default = str(int(default_limit)).encode()
        self._dedupe_prefix = f"{keys.namespace}:job:{{".encode()

    def command(self, jobs: Sequence[Prepared]) -> bytes:
        """One EVALSHA for jobs that all go to the same lane."""
        pre = self._dedupe_prefix
        dkeys = [pre + j.job_id.encode() + b"}" for j in jobs]
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
    for lane in ("urgent", "default", "bulk"):
        idx = by_lane.get(lane, [])
        chunks.extend(idx[s:s + size] for s in range(0, len(idx), size))
    return chunks


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
