"""Sans-IO core shared by the sync and async clients: enqueue calls, reply parsing, reads.

Nothing here touches a socket, so ``Client`` and ``AsyncClient`` differ only in how they wait.
Payloads are built in ``payloads`` (``PayloadBuilder``); this module sends them: one call of the
enqueue script (``protocol.scripts.ENQUEUE``, its contract there) per chunk of jobs, pipelined,
with the script's replies turned into per-job outcomes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from redis.exceptions import (AskError, ClusterDownError, OutOfMemoryError, ResponseError,
                              TryAgainError)

from tokenrelay.producer_sdk.affinity import affinity_target
from tokenrelay.producer_sdk.payloads import Prepared
from tokenrelay.protocol.errors import ProtocolError
from tokenrelay.protocol.keys import Keys, key_slot, parse_dedupe_record
from tokenrelay.protocol.scripts import ENQUEUE, pack
from tokenrelay.protocol.scripts.resp import bulk, bulk_pairs, bulk_prefixed, pack_parts
from tokenrelay.protocol.topology import Packed

DEFAULT_MAX_QUEUED_JOBS = 100_000


@dataclass
class EnqueueOutcome:
    """What one script call said about each job of its chunk."""

    new: list[tuple[int, Any]] = field(default_factory=list)        # (index, 1)
    known: list[tuple[int, str]] = field(default_factory=list)      # (index, dedupe record)
    refused: list[int] = field(default_factory=list)                # queue full
    depth: Optional[int] = None
    limit: Optional[int] = None
    tokens: Optional[int] = None        # the shard's queued tokens when the budget refused
    token_limit: Optional[int] = None   # the shard's share of max_queued_tokens


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def parse_enqueue_reply(reply: Sequence[Any], indexes: Sequence[int]) -> EnqueueOutcome:
    """Per job of the chunk ``indexes``: new, known or refused; and, when some were refused,
    which bound refused them (the job count: ``depth``; the token budget: ``tokens``)."""
    out = EnqueueOutcome(limit=int(reply[1]), token_limit=int(reply[3]))
    results = reply[4:]
    new, known = out.new, out.known
    for idx, r in zip(indexes, results):
        if type(r) is not int and r[:1] in (b"=", "="):
            known.append((idx, _s(r)[1:]))
        else:
            new.append((idx, r))        # 1 (the script's reply for an enqueued job)
    if len(results) < len(indexes):
        out.refused = list(indexes[len(results):])
        if int(reply[2]) >= 0:
            out.tokens = int(reply[2])
        else:
            out.depth = int(reply[0])
    return out


@dataclass
class QueueState:
    """What a producer knows of one queue it sends to: its keys (the shard count resolved),
    its high-water mark (0: no back-pressure), its token budget (``max_queued_tokens``, 0:
    none), whether the count is the one the queue's workers registered, and when the marks are
    read again (monotonic seconds)."""

    keys: Keys
    limit: int
    registered: bool
    expires: float
    token_limit: int = 0

    def shard_tokens(self) -> int:
        """Each shard's share of the token budget: a shard's script sees only its own slot, so
        the budget is split evenly, rounded up (0: none)."""
        return -(-self.token_limit // self.keys.shards)


class EnqueueScript:
    """Packs chunks of prepared jobs into EVALSHA commands for the enqueue script."""

    def __init__(self, ttl_s: int) -> None:
        self.sha = ENQUEUE.sha.encode()
        self._ttl = str(int(ttl_s)).encode()

    def command(self, keys: Keys, shard: int, jobs: Sequence[Prepared], limit: int,
                other_depth: int, durable: bool, token_limit: int = 0) -> bytes:
        """One EVALSHA for jobs that all go to the same lane of shard ``shard``, or all to one
        worker's affinity stream on that shard (their lane is then the fallback);
        ``token_limit`` is the shard's share of the token budget."""
        lane = keys.lane(jobs[0].lane, shard)
        stream = affinity_target(keys, jobs[0], shard)
        # an affinity target: the jobs' own lane first (KEYS[2], the fallback), then the others
        head = keys.lanes(shard) if stream is None else [
            lane, *(k for k in keys.lanes(shard) if k != lane)]
        n = len(jobs)
        return pack_parts(13 + 3 * n, (
            *bulk([b"EVALSHA", self.sha, b"%d" % (5 + n), (stream or lane).encode(),
                   *[k.encode() for k in head], keys.budget(shard).encode()]),
            *bulk_prefixed(keys.dedupe_prefix(shard).encode(), [j.job_id.encode() for j in jobs]),
            *bulk([b"%d" % limit, self._ttl, b"%d" % other_depth, b"1" if durable else b"",
                   b"%d" % token_limit]),
            *bulk_pairs([(j.payload, b"%d" % j.cost) for j in jobs])))


def chunk_jobs(indexes: Iterable[int], jobs: Sequence[Prepared],
               size: int) -> list[list[int]]:
    """Group job indexes into chunks of one lane of one shard of one queue each (the client's
    queue first, then by name; shards in order; lanes most urgent first), preserving order
    within a lane: every chunk is one script call whose keys share one slot. Jobs routed to a
    worker's affinity stream chunk by worker after that lane's shared jobs."""
    groups: dict[tuple[str, int, str, str], list[int]] = {}
    last_key: Optional[tuple[str, int, str, str]] = None
    last: list[int] = []
    for i in indexes:
        j = jobs[i]
        key = (j.queue or "", j.shard or 0, j.lane, j.affinity or "")
        if key != last_key:         # a bulk submit is one long run of one key: no dict per job
            last_key, last = key, groups.setdefault(key, [])
        last.append(i)
    order = sorted(groups, key=lambda g: (g[0], g[1], Keys.LANES.index(g[2]), g[3]))
    return [idx[s:s + size] for g in order for idx in (groups[g],)
            for s in range(0, len(idx), size)]


def record_location(keys: Keys, record: Any, shard: int = 0) -> tuple[str, str]:
    """(lane key, entry id) a job's dedupe record names, for an XRANGE that finds nothing when
    there is no record (or it is unreadable): then the default lane of the job's ``shard``, so
    every read of one job stays in its shard's slot."""
    if record:
        try:
            return parse_dedupe_record(record)
        except ProtocolError:
            pass
    return keys.lane("default", shard), "0-0"


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


def is_transient(reply: Any) -> bool:
    """A reply a cluster gives while it moves a slot or fails a master over (CLUSTERDOWN,
    TRYAGAIN, a MOVED/ASK left after the sender's one resend): send again shortly."""
    return isinstance(reply, (ClusterDownError, TryAgainError, AskError))


def merge_xreads(blocking: Any, follow_up: Any) -> list[tuple[str, list[tuple[bytes, dict]]]]:
    """One answer from a blocking multi-stream XREAD and the non-blocking XREAD for the same ids
    pipelined right behind it.

    Why the pair: before Redis 7.2 a blocked multi-stream XREAD is answered with only the first
    stream that got data, although a worker writes all its jobs' streams in one step; the
    follow-up runs the moment the blocking read is answered and brings the others, without a
    client round trip. Both start from the same ids, so per stream the longer list wins."""
    return merge_reads([normalize_xread(blocking), normalize_xread(follow_up)])


def merge_reads(reads: Iterable[list[tuple[str, list]]]) -> list[tuple[str, list]]:
    """Several normalized XREAD answers as one; per stream the longest list wins (reads of one
    stream start from the same id)."""
    merged: dict[str, list] = {}
    for read in reads:
        for key, entries in read:
            if len(entries) > len(merged.get(key, ())):
                merged[key] = entries
    return list(merged.items())


# A read of result streams in several cluster slots blocks on one slot per node at a time, so
# it blocks in slices this long and then reads every slot again: an event of another slot waits
# at most one slice. (One slot, or one Redis, blocks for the whole wait.)
XREAD_SLICE_MS = 50


def xread_command(streams: Mapping[str, bytes], keys: Sequence[str], count: int,
                  block_ms: Optional[int]) -> bytes:
    """A packed XREAD of ``keys`` from their last ids in ``streams``."""
    head = [b"XREAD", b"COUNT", b"%d" % count]
    if block_ms is not None:
        head += [b"BLOCK", b"%d" % block_ms]
    return pack([*head, b"STREAMS", *[k.encode() for k in keys],
                         *[streams[k] for k in keys]])


def slot_groups(keys: Iterable[str]) -> list[list[str]]:
    """Stream keys grouped by cluster slot (a cluster refuses a multi-key XREAD across slots);
    per-job keys of one queue shard share its hash tag, so a window of many jobs is one group
    per shard."""
    groups: dict[int, list[str]] = {}
    for k in keys:
        groups.setdefault(key_slot(k), []).append(k)
    return list(groups.values())


def sliced_xread(streams: Mapping[str, bytes], node_of: Callable[[str], Any], count: int,
                 block_ms: int) -> list[Packed]:
    """One round of reading streams spread over several slots: per node, a blocking XREAD of
    its first slot group (for at most one slice) and the non-blocking XREAD of every group of
    it behind it (the first one again too: see ``merge_xreads``)."""
    out: list[Packed] = []
    blocking: set[Any] = set()
    for group in slot_groups(streams):
        node = node_of(group[0])
        cmds = [xread_command(streams, group, count, None)]
        if node not in blocking:
            blocking.add(node)
            cmds.insert(0, xread_command(streams, group, count, min(block_ms, XREAD_SLICE_MS)))
        out.append((group[0], b"".join(cmds), len(cmds)))
    return out


def parse_raw_xread(reply: Any) -> list[tuple[str, list[tuple[bytes, dict]]]]:
    """A raw XREAD reply (RESP2 list or RESP3 map, fields as a flat list, as a connection
    returns it without redis-py's callbacks) as ``normalize_xread`` gives it."""
    if isinstance(reply, Exception):
        raise reply
    if not reply:
        return []
    pairs = reply.items() if isinstance(reply, dict) else reply
    out = []
    for key, entries in pairs:
        out.append((_s(key), [(eid, fields_dict(raw)) for eid, raw in entries or ()]))
    return out


def fields_dict(raw: Any) -> dict:
    """A stream entry's fields as a dict, from redis-py's dict or the raw flat list (a reply
    read without redis-py's callbacks, as a cluster MULTI returns them too)."""
    if isinstance(raw, dict):
        return raw
    raw = raw or []
    return {raw[i]: raw[i + 1] for i in range(0, len(raw) - 1, 2)}




def xlen_reads(keys: Keys) -> list[Packed]:
    """XLEN of every lane of every shard of a queue, each routed to its shard's node."""
    return [(lane, pack([b"XLEN", lane.encode()]), 1) for lane in keys.lanes()]


def shard_depths(keys: Keys, replies: Sequence[Any]) -> list[int]:
    """Per shard, the sum of its lanes' XLEN replies (``xlen_reads`` order)."""
    n = len(Keys.LANES)
    for r in replies:
        if isinstance(r, Exception):
            raise r
    return [sum(int(r) for r in replies[s * n:(s + 1) * n]) for s in range(keys.shards)]


class EnqueuePlan:
    """Tracks which jobs of one submit call still need a script call, round after round.

    A round is one batch of EVALSHA commands, one per chunk (one lane of one queue shard),
    sent with ``topology.send_packed``: one round trip per node. Before it, for every queue of
    more than one shard with a high-water mark, one pipelined XLEN round over all its lanes
    (``depth_reads``) gives each chunk the depth of the queue's other shards, plus the jobs
    the round's earlier chunks may add there: back-pressure holds for the queue as a whole,
    conservatively within a round (a chunk counts every job of the chunks before it as new).
    Chunks refused for back-pressure (queue full or Redis OOM) wait for the next round; chunks
    that hit NOSCRIPT are resent once the script is loaded. Because the script dedupes by job
    id, resending anything is always safe. With ``durable``, each job keeps the WAIT reply of
    the node that answered it (``acks``).
    """

    def __init__(self, jobs: Sequence[Prepared], script: EnqueueScript, chunk_size: int,
                 durable: bool = False) -> None:
        self.jobs = jobs
        self.script = script
        self.chunk_size = chunk_size
        self.durable = durable
        self.entries: list[Optional[tuple[bool, Any]]] = [None] * len(jobs)  # (known, value)
        self.acks: list[Optional[int]] = [None] * len(jobs)
        self.todo: list[int] = list(range(len(jobs)))
        self.refused: list[int] = []
        self.depth: Optional[int] = None
        self.limit: Optional[int] = None
        self.tokens: Optional[int] = None          # set when the token budget refused
        self.token_limit: Optional[int] = None
        self.oom = False
        self._depth_queues: list[Optional[str]] = []

    def queues(self) -> list[Optional[str]]:
        """The queues (None: the client's) of the jobs the next round sends."""
        return sorted({self.jobs[i].queue for i in self.todo}, key=lambda q: q or "")

    def place(self, states: Mapping[Optional[str], QueueState]) -> None:
        """Put each job still to send on its shard: ``shard_of(job_id)`` with its queue's count."""
        jobs = self.jobs
        if all(st.keys.shards == 1 for st in states.values()):
            for i in self.todo:
                jobs[i].shard = 0
            return
        for i in self.todo:
            job = jobs[i]
            job.shard = states[job.queue].keys.shard_of(job.job_id)

    def depth_reads(self, states: Mapping[Optional[str], QueueState]) -> list[Packed]:
        """The XLEN round before the next round: for queues of several shards with a limit."""
        self._depth_queues = [q for q in self.queues()
                              if states[q].keys.shards > 1 and states[q].limit > 0]
        return [r for q in self._depth_queues for r in xlen_reads(states[q].keys)]

    def round(self, states: Mapping[Optional[str], QueueState],
              depth_replies: Sequence[Any] = ()) -> list[tuple[list[int], Packed]]:
        """The commands of the next round (empty when everything was answered), each with the
        indexes of its jobs; ``depth_replies`` answer ``depth_reads``."""
        depths: dict[Optional[str], list[int]] = {}
        at = 0
        for q in self._depth_queues:
            n = len(states[q].keys.lanes())
            depths[q] = shard_depths(states[q].keys, depth_replies[at:at + n])
            at += n
        todo, self.todo = sorted(self.todo), []
        sent: dict[Optional[str], list[int]] = {}
        out = []
        for idx in chunk_jobs(todo, self.jobs, self.chunk_size):
            first = self.jobs[idx[0]]
            st, shard = states[first.queue], first.shard or 0
            other = 0
            if first.queue in depths:
                mine = sent.setdefault(first.queue, [0] * st.keys.shards)
                d = depths[first.queue]
                other = sum(d) - d[shard] + sum(mine) - mine[shard]
                if first.affinity is None:      # routed jobs do not add to the depth
                    mine[shard] += len(idx)
            # packed when it is sent (``topology._stream``: packing overlaps Redis running
            # the calls before it)
            cmd = functools.partial(self.script.command, st.keys, shard,
                                    [self.jobs[i] for i in idx], st.limit, other, self.durable,
                                    st.shard_tokens())
            out.append((idx, (st.keys.lane(first.lane, shard), cmd, 1)))
        return out

    def refused_queue(self, default: str) -> str:
        """The queue that refused (for QueueFull): that of the first refused job."""
        return (self.jobs[self.refused[0]].queue if self.refused else None) or default

    def on_reply(self, indexes: list[int], reply: Sequence[Any], ack: Any = None) -> None:
        out = parse_enqueue_reply(reply, indexes)
        for i, entry_id in out.new:
            self.entries[i] = (False, entry_id)
            self.acks[i] = ack
        for i, record in out.known:
            self.entries[i] = (True, record)
            self.acks[i] = ack
        if out.refused:
            self.refused.extend(out.refused)
            self.depth, self.limit = out.depth, out.limit
            self.tokens, self.token_limit = out.tokens, out.token_limit

    def resend(self, indexes: list[int]) -> None:
        self.todo.extend(indexes)

    def refuse_oom(self, indexes: list[int]) -> None:
        self.refused.extend(indexes)
        self.oom = True

    def requeue_refused(self) -> None:
        self.todo.extend(self.refused)
        self.refused = []
        self.oom = False
        self.tokens = self.depth = None

    def refusal(self) -> str:
        """Which bound refused the jobs left in ``refused`` (QueueFull's ``reason``)."""
        if self.oom:
            return "oom"
        return "token budget" if self.tokens is not None else "high-water mark"

    def accepted(self) -> list[int]:
        return [i for i, e in enumerate(self.entries) if e is not None]

    def short_of(self, replicas: int) -> tuple[int, list[int]]:
        """For a durable submit: the fewest replicas any answered job was acknowledged by, and
        the jobs acknowledged by fewer than ``replicas`` (a WAIT error reply counts as 0)."""
        counts = [(i, a if isinstance(a, int) else 0) for i, a in enumerate(self.acks)
                  if self.entries[i] is not None]
        short = [i for i, a in counts if a < replicas]
        return min((a for _, a in counts), default=replicas), short
