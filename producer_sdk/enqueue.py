"""Sending prepared jobs: the enqueue of ``submit``, ``submit_many`` and every window, as one plan.

All enqueueing goes through one Lua script (``protocol.scripts.ENQUEUE``) that checks the queue's
high-water mark and sets the job's dedupe record together with the XADD, so retries never create
a second job; a queue of several shards gets one call per chunk of a shard, all sent in one round
trip per Redis node (``Send``). ``EnqueuePlan`` (``_wire``) keeps the per-job bookkeeping; this
module decides the rounds: when to load the script, read the queues' config and depth, resend,
wait for room, or give up.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

from redis.exceptions import NoScriptError

from tokenrelay.producer_sdk._wire import EnqueuePlan, EnqueueScript, is_oom, is_transient
from tokenrelay.producer_sdk.affinity import AffinityRouter
from tokenrelay.producer_sdk.config import ClientConfig
from tokenrelay.producer_sdk.effects import SEND_ERRORS, Call, Plan, Send, Sleep, cluster
from tokenrelay.producer_sdk.errors import RedisUnavailable
from tokenrelay.producer_sdk.job import Deadline
from tokenrelay.producer_sdk.payloads import Prepared, gc_paused
from tokenrelay.producer_sdk.queues import QueueBook
from tokenrelay.protocol.topology import Packed
from tokenrelay.protocol.scripts import ENQUEUE, pack


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
                elif is_transient(rep):
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


__all__ = ["Enqueuer", "Retrying"]
