"""Sans-IO core shared by the sync and async clients: the enqueue script, reply parsing, reads.

Nothing here touches a socket, so ``Client`` and ``AsyncClient`` differ only in how they wait.
Payloads are built in ``payloads`` (``PayloadBuilder``); this module sends them: one script call
per chunk of jobs, pipelined, with the script's replies turned into per-job outcomes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

from redis.exceptions import OutOfMemoryError, ResponseError

from producer_sdk.affinity import affinity_target
from producer_sdk.payloads import Prepared
from producer_sdk.protocol import (DEDUPE_SEPARATOR, PAYLOAD_FIELD, Keys, ProtocolError,
                                   parse_dedupe_record)

DEFAULT_MAX_QUEUED_JOBS = 100_000

# One script call enqueues a whole chunk: per job, SET-if-absent of the dedupe record and XADD
# happen atomically, so a retried call (redis-py retries on timeouts) never enqueues twice.
# KEYS: target lane, the three lanes (depth), config hash, then one dedupe key per job.
# A target that is none of the three lanes is a worker's affinity stream (producer_sdk/
# affinity.py); KEYS[2] is then the jobs' own lane, where they go instead when that stream does
# not exist: its worker deleted it when it drained, or a sweep did after it died, so a job
# routed on a stale view of the workers is never left where nobody reads.
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
if lane ~= KEYS[2] and lane ~= KEYS[3] and lane ~= KEYS[4] and redis.call('EXISTS', lane) == 0 then
  lane = KEYS[2]
end
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
        # For an affinity stream target: the jobs' own lane first (the fallback), then the others.
        self._affinity_head = {name: [self._lanes[name], *(self._lanes[n] for n in keys.LANES
                                                           if n != name), self._head[-1]]
                               for name in keys.LANES}
        self._limit = b"" if limit is None else str(int(limit)).encode()
        self._ttl = str(int(ttl_s)).encode()
        self._default = str(int(default_limit)).encode()

    def command(self, jobs: Sequence[Prepared]) -> bytes:
        """One EVALSHA for jobs that all go to the same lane (or affinity stream)."""
        dedupe = self.keys.dedupe
        dkeys = [dedupe(j.job_id).encode() for j in jobs]
        stream = affinity_target(self.keys, jobs[0])
        target, head = ((self._lanes[jobs[0].lane], self._head) if stream is None else
                        (stream.encode(), self._affinity_head[jobs[0].lane]))
        args = [b"EVALSHA", self.sha, b"%d" % (5 + len(jobs)), target,
                *head, *dkeys, self._limit, self._ttl, self._default,
                *[j.payload for j in jobs]]
        return pack_command(args)


def chunk_by_lane(indexes: Iterable[int], jobs: Sequence[Prepared],
                  size: int) -> list[list[int]]:
    """Group job indexes into chunks of one lane of one queue each (the client's queue first),
    preserving order within a lane; jobs routed to a worker's affinity stream chunk by worker
    after that lane's shared jobs."""
    by_lane: dict[tuple[str, str, str], list[int]] = {}
    for i in indexes:
        by_lane.setdefault((jobs[i].queue or "", jobs[i].lane, jobs[i].affinity or ""),
                           []).append(i)
    order = {lane: n for n, lane in enumerate(Keys.LANES)}
    chunks: list[list[int]] = []
    for key in sorted(by_lane, key=lambda k: (k[0], order[k[1]], k[2])):
        idx = by_lane[key]
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

    def __init__(self, jobs: Sequence[Prepared], scripts: Callable[[Optional[str]], EnqueueScript],
                 chunk_size: int) -> None:
        self.jobs = jobs
        self.scripts = scripts          # queue (None: the client's) -> its enqueue script
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
        return [(idx, self.scripts(self.jobs[idx[0]].queue).command([self.jobs[i] for i in idx]))
                for idx in chunk_by_lane(todo, self.jobs, self.chunk_size)]

    def refused_queue(self, default: str) -> str:
        """The queue that refused (for QueueFull): that of the first refused job."""
        return (self.jobs[self.refused[0]].queue if self.refused else None) or default

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
