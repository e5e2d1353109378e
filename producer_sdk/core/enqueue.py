"""Sending prepared jobs: the enqueue of ``submit``, ``submit_many`` and every window, as one plan.

All enqueueing goes through one Lua script (``protocol.scripts.ENQUEUE``) that checks the queue's
high-water mark and sets the job's dedupe record together with the XADD, so retries never create
a second job; a queue of several shards gets one call per chunk of a shard, all sent in one round
trip per Redis node (``Send``). The one home of enqueueing: the script's commands
(``EnqueueScript``, ``chunk_jobs``), its replies (``parse_enqueue_reply``), the per-job
bookkeeping of one submit (``EnqueuePlan``) and the rounds that drive it (``Enqueuer``: when to
load the script, read the queues' config and depth, resend, wait for room, or give up).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

from redis.exceptions import AskError, ClusterDownError, NoScriptError, TryAgainError

from tokenrelay.producer_sdk.core.affinity import AffinityRouter, affinity_target
from tokenrelay.producer_sdk.config import ClientConfig
from tokenrelay.producer_sdk.core.effects import SEND_ERRORS, Call, Plan, Send, Sleep, cluster, is_oom
from tokenrelay.producer_sdk.errors import RedisUnavailable
from tokenrelay.producer_sdk.jobs.job import Deadline
from tokenrelay.producer_sdk.jobs.payloads import Prepared, gc_paused
from tokenrelay.producer_sdk.core.queues import QueueBook, QueueState, shard_depths, xlen_reads
from tokenrelay.protocol.keys import Keys
from tokenrelay.protocol.scripts import ENQUEUE, pack
from tokenrelay.protocol.scripts.resp import bulk, bulk_pairs, bulk_prefixed, pack_parts
from tokenrelay.protocol.topology import Packed


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


def is_transient_reply(reply: Any) -> bool:
    """A reply a cluster gives while it moves a slot or fails a master over (CLUSTERDOWN,
    TRYAGAIN, a MOVED/ASK left after the sender's one resend): send again shortly."""
    return isinstance(reply, (ClusterDownError, TryAgainError, AskError))


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


class Retrying:
    """How long one enqueue keeps resending what a lost connection or a failing-over cluster
    did not answer: on one Redis a single retry after 0.1 s (fail fast: it is down), on a
    cluster up to ``window_s`` (a failover takes seconds; every resend is safe, the enqueue
    script dedupes by job id), pausing 0.1 s doubling to 1 s."""

    def __init__(self, window_s: float) -> None:
        self.end = time.monotonic() + window_s
        self.tries = 0
        self.pause_s = 0.1

    def pause(self) -> Optional[float]:
        """Seconds to wait before the next try, None when it is time to give up."""
        self.tries += 1
        if self.tries > 1 and time.monotonic() >= self.end:
            return None
        pause, self.pause_s = self.pause_s, min(self.pause_s * 2, 1.0)
        return pause


class Enqueuer:
    """Runs the rounds of one enqueue: the queues' config when due (``QueueBook``), the routing
    of keyed jobs (``AffinityRouter``), the other shards' depth when a queue has several, the
    script calls and a durable submit's WAIT per node."""

    def __init__(self, queues: QueueBook, router: AffinityRouter, config: ClientConfig,
                 url: str) -> None:
        self.queues = queues
        self.router = router
        self.script = EnqueueScript(config.dedupe_ttl_s)
        self.chunk_size = config.chunk_size
        self.durable = config.durable
        self.window_s = config.reconnect_timeout_s
        self.url = url
        self.wait = pack([b"WAIT", b"%d" % config.durable_replicas,
                                  b"%d" % config.durable_timeout_ms])
        self.loaded = False         # the script was loaded (on every master of a cluster)
        self.cluster: Optional[bool] = None     # the client is a cluster client (asked once)

    def plan(self, prepared: Sequence[Prepared], block: bool, block_timeout: Optional[float],
             durable: Optional[bool]) -> Plan[EnqueuePlan]:
        """Send ``prepared``; the answered plan. Jobs still refused for back-pressure are left
        in ``refused`` (the caller raises QueueFull): at once unless ``block``, else once
        ``block_timeout`` passed."""
        batch = EnqueuePlan(list(prepared), self.script, self.chunk_size,
                            self.durable if durable is None else durable)
        if not batch.jobs:
            return batch
        if not self.loaded:
            # Load once up front: a NOSCRIPT reply would make the first round travel twice.
            yield Call(lambda r: r.script_load(ENQUEUE.source))
            self.loaded = True
        yield from self.router.route_plan(batch.jobs)
        if self.cluster is None:
            self.cluster = yield cluster()
        deadline = Deadline(block_timeout)
        retry = Retrying(self.window_s if self.cluster else 0.0)
        pause = 0.02
        while True:
            if batch.todo:
                failed = yield from self._round(batch, retry)
                if failed is not None:      # a cluster failing over: wait, send the rest again
                    wait = retry.pause()
                    if wait is None:
                        raise RedisUnavailable(self.url, failed)
                    yield Sleep(wait)
                continue
            if not batch.refused or not block or deadline.expired:
                return batch
            yield Sleep(pause)
            pause = min(pause * 2, 0.5)
            batch.requeue_refused()

    def _round(self, batch: EnqueuePlan, retry: Retrying) -> Plan[Optional[Exception]]:
        """One round; returns the error of calls a failing-over cluster refused (they are to be
        resent)."""
        states = {}
        for q in batch.queues():
            states[q] = yield from self.queues.state(q, fresh=True, register=True)
        with gc_paused():           # per-job bookkeeping of a bulk round: see gc_paused
            batch.place(states)
        reads = batch.depth_reads(states)
        depths = (yield from self._send(reads, retry))[0] if reads else []
        with gc_paused():
            cmds = batch.round(states, depths)
        replies, acks = yield from self._send([c for _, c in cmds], retry,
                                              self.wait if batch.durable else None)
        load, failed = False, None
        with gc_paused():
            for (idx, _), rep, ack in zip(cmds, replies, acks):
                if isinstance(rep, NoScriptError):
                    batch.resend(idx)
                    load = True
                elif is_oom(rep):
                    batch.refuse_oom(idx)
                elif is_transient_reply(rep):
                    batch.resend(idx)
                    failed = rep
                elif isinstance(rep, Exception):
                    raise rep
                else:
                    batch.on_reply(idx, rep, ack)
        if load:
            yield Call(lambda r: r.script_load(ENQUEUE.source))
        return failed

    def _send(self, items: list[Packed], retry: Retrying, trailer: Optional[bytes] = None,
              ) -> Plan[tuple[list[Any], list[Any]]]:
        """One round trip per node. A dropped connection resends the whole batch (``retry``
        says how long): the enqueue script is idempotent per job id, and XLEN and WAIT only
        read."""
        while True:
            try:
                return (yield Send(items, trailer))
            except SEND_ERRORS as exc:
                wait = retry.pause()
                if wait is None:
                    raise RedisUnavailable(self.url, exc) from exc
                yield Sleep(wait)


__all__ = ["Enqueuer", "Retrying", "EnqueuePlan", "EnqueueScript", "EnqueueOutcome",
           "parse_enqueue_reply", "chunk_jobs", "is_transient_reply"]
