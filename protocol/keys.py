"""Every Redis key and stream field name of protocol v1: one place builds them all.

A queue is split into shards; every key of a shard carries the shard's hash tag (``shard_tag``)
so each Lua script's keys share one Redis Cluster slot. ``docs/protocol.md`` ("Keys") describes
the layout for people and must change together with this module.
"""

from __future__ import annotations

import functools
import zlib
from typing import Optional, Union

from tokenrelay.protocol.errors import ProtocolError

# The consumer group every worker of a queue reads its job streams in.
GROUP = "workers"
# Job stream entries carry the msgpack JobRequest in this field.
PAYLOAD_FIELD = b"data"
# Result stream entries carry the event in ``data`` and a write-batch id in ``b`` (opaque; the
# worker uses it to make retried writes idempotent). Readers ignore ``b``.
EVENT_FIELD = b"data"
BATCH_FIELD = b"b"
# Job stream entries enqueued by the SDK also carry the job's admitted token cost (decimal text)
# in this field, beside the payload: the worker's terminal write releases exactly that much from
# the shard's budget counter (``Keys.budget``; protocol/budget.py). Absent means 0.
COST_FIELD = b"cost"
# Consumer name that holds jobs a draining worker handed back: it never has a heartbeat, and its
# entries are parked with an idle time of PARKED_IDLE_MS so any reclaimer takes them at once.
PARKING_CONSUMER = "__parked__"
PARKED_IDLE_MS = 10**12
# The dedupe record ``Keys.dedupe(job_id)`` holds "<lane key><DEDUPE_SEPARATOR><entry id>": the
# one entry that is this job. Lane keys and entry ids never contain a space.
DEDUPE_SEPARATOR = " "

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

    def budget(self, shard: int = 0) -> str:
        """The shard's token budget counter: the sum of the admitted costs of its jobs that have
        no terminal event yet (the enqueue script adds, the terminal write subtracts)."""
        return f"{self.namespace}:budget:{self.tag(shard)}"

    def budgets(self) -> list[str]:
        return [self.budget(s) for s in range(self.shards)]

    def dead_streams(self) -> list[str]:
        return [self.dead(s) for s in range(self.shards)]

    @property
    def workers(self) -> str:
        """Sorted set: worker id -> epoch ms of its last heartbeat."""
        return f"{self.namespace}:workers:{self.queue}"

    @property
    def config(self) -> str:
        """Hash of queue settings shared by all producers and workers (``max_queued_jobs``,
        ``max_queued_tokens``, ``shards``)."""
        return f"{self.namespace}:config:{self.queue}"

    def heartbeat(self, worker_id: str) -> str:
        return f"{self.namespace}:worker:{worker_id}"

    @property
    def queues(self) -> str:
        """Set of the namespace's queue names that workers serve (each worker adds its queue at
        every heartbeat): producers find every queue's workers without scanning the keyspace
        (``producer_sdk.core.models``). Never pruned; a queue without live workers is just empty."""
        return f"{self.namespace}:queues"

    def drain(self, worker_id: str) -> str:
        """Drain request for one worker (set by ``worker admin drain``, with a TTL): while it
        exists the worker drains as on SIGTERM, then exits 0."""
        return f"{self.namespace}:drain:{self.queue}:{worker_id}"

    @property
    def tokenize_calls(self) -> str:
        """Stream of the queue's tokenize/detokenize calls (``protocol/tokenize.py``), read by
        its workers in the ``GROUP`` consumer group: the gateway's ``/tokenize`` answered with
        the tokenizer and chat template the queue's jobs are tokenized with."""
        return f"{self.namespace}:tokenize:{self.queue}"

    def tokenize_reply(self, call_id: str) -> str:
        """Stream the answer to one tokenize call is written to (one entry, short TTL)."""
        return f"{self.namespace}:tokenize-reply:{self.queue}:{call_id}"

    # -- per-job keys (in the slot of the job's shard; shard None: where the job id goes)
    def results(self, job_id: str, shard: Optional[int] = None) -> str:
        return f"{self.namespace}:result:{self.tag(self._job_shard(job_id, shard))}:{job_id}"

    def cancel(self, job_id: str, shard: Optional[int] = None) -> str:
        return f"{self.namespace}:cancel:{self.tag(self._job_shard(job_id, shard))}:{job_id}"

    def dedupe(self, job_id: str, shard: Optional[int] = None) -> str:
        """Set with the XADD: holds ``dedupe_record(lane key, entry id)``; its presence means
        'job known', and its value names the one entry that is this job."""
        return self.dedupe_prefix(self._job_shard(job_id, shard)) + job_id

    def dedupe_prefix(self, shard: int) -> str:
        """What every dedupe record key of ``shard`` starts with (the job id follows): the
        bulk enqueue builds a chunk's keys from it without a call per job."""
        return f"{self.namespace}:job:{self.tag(shard)}:"

    def owner(self, job_id: str, shard: Optional[int] = None) -> str:
        """Fencing record: which worker currently owns the job (written by workers only)."""
        return f"{self.namespace}:owner:{self.tag(self._job_shard(job_id, shard))}:{job_id}"


def hash_tag(key: str) -> str:
    """What Redis Cluster hashes of ``key``: the text inside its first ``{...}`` when that is
    not empty, else the whole key."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1:end]
    return key


def wake_key(namespace: str, slot_key: str, reader_id: str) -> str:
    """A shared result reader's private wake stream, in the slot of ``slot_key`` (one of the
    result streams it reads), so one XREAD can name it with them: a producer XADDs to it to
    interrupt the reader's blocked XREAD when a job joins (``producer_sdk/core/hub.py``). Capped at
    one entry and expiring (``WAKE_TTL_MS`` after its last wake)."""
    return f"{namespace}:wake:{{{hash_tag(slot_key)}}}:{reader_id}"


WAKE_TTL_MS = 600_000


def stream_session_key(namespace: str, job_id: str) -> str:
    """A gateway stream's resume record (hash): who may resume the job's SSE stream, how it is
    rendered, and whether a client holds it (``live``), left it within its grace (``parked``),
    saw it end (``ended``) or let the grace pass (``cancelled``). Its own slot, tagged by the
    job id: the gateway finds it from an SSE event id alone, before it knows the job's queue
    (``protocol/scripts/streams.py``)."""
    return f"{namespace}:gwstream:{{{job_id}}}"


def parked_streams_key(namespace: str) -> str:
    """Sorted set of the namespace's parked gateway streams: job id -> epoch ms its grace
    ends. Every gateway sweeps it, so a parked job is cancelled on time even when the gateway
    that parked it died."""
    return f"{namespace}:gwparked"


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
