"""Which models the live workers of a namespace serve, and on which queues: the one listing.

A worker advertises its ``served_model_name`` and its queue in its heartbeat hash
(``Keys.heartbeat``, TTL 5 beats, deleted on a clean exit), lists itself in its queue's registry
(``Keys.workers``) and its queue in the namespace's queue set (``Keys.queues``). A producer that
must route a request by its ``model`` (the HTTP gateway, the batch runner) or answer
``/v1/models`` reads those keys here, in three pipelined round trips whatever the number of
queues and workers (no keyspace scan), so it is cheap enough per request; ``ModelCache`` /
``AsyncModelCache`` add a short TTL for callers that want less than that.

Live means: the heartbeat hash still exists (a dead or frozen worker's expires within 5 beats;
its registry entry may linger, which is why the hash decides), its engine is loaded, it is not
draining (it takes no new jobs), and it names this queue (``Heartbeat.serving``; the hash's
schema is protocol/heartbeat.py). The sync and async variants share all the logic
(``listing``, a plan); the SDK's two drivers run it (``producer_sdk.core.effects``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from tokenrelay.producer_sdk.core.effects import Plan, arun, pipeline, pipelined, run
from tokenrelay.producer_sdk.errors import ModelNotFound
from tokenrelay.protocol.heartbeat import FIELDS, Heartbeat, live_beats, queue_model
from tokenrelay.protocol.keys import Keys


@dataclass(frozen=True)
class ServedModel:
    """One model name served by live workers: on which queues, by which workers, since when.

    ``created`` (epoch seconds) is the start of its longest-running live worker: the
    ``created`` of OpenAI's model object. ``workers`` are ``(queue, worker id)`` pairs.
    ``tool_format``: what the model's chat template does with tools (protocol/tools.py), when
    every live worker of it says the same; None when one says nothing (an older worker) or
    they disagree."""

    name: str
    queues: tuple[str, ...]
    workers: tuple[tuple[str, str], ...]
    created: int
    tool_format: Optional[str] = None

    @property
    def queue(self) -> str:
        """The queue to send a request for this model to: the one with the most live workers
        serving it (ties: the first by name), so a model served on several queues goes where
        it is served most."""
        count = {q: sum(1 for wq, _ in self.workers if wq == q) for q in self.queues}
        return min(self.queues, key=lambda q: (-count[q], q))


def _s(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def listing(namespace: str) -> Plan[dict[str, ServedModel]]:
    """The listing as a plan: three pipelines, one round trip each."""
    ns = Keys(namespace)
    (queues,) = yield pipeline([("SMEMBERS", ns.queues)])
    names = sorted(_s(q) for q in queues or ())
    if not names:
        return {}
    registries = yield pipeline([("ZRANGE", Keys(namespace, q).workers, 0, -1) for q in names])
    pairs = [(q, _s(w)) for q, ids in zip(names, registries) for w in ids or ()]
    if not pairs:
        return {}
    rows = yield pipeline([("HMGET", ns.heartbeat(w), *FIELDS) for _, w in pairs])
    return _models(pairs, [Heartbeat.from_row(row) for row in rows])


def live_workers(namespace: str, queue: str) -> Plan[list[str]]:
    """The ids of ``queue``'s live workers (``Heartbeat.serving``), as a plan. The reading is
    the contract's (``protocol.heartbeat.live_beats``, shared with the worker, which has no
    effects of its own), bridged by ``effects.pipelined``."""
    return sorted((yield from pipelined(live_beats(namespace, queue))))


def _models(pairs: list[tuple[str, str]],
            beats: list[Optional[Heartbeat]]) -> dict[str, ServedModel]:
    """Group live workers' heartbeats (None: the hash is gone) by served model name; a queue
    lists only the model it is served with (``queue_model``), never a second one."""
    by_queue: dict[str, dict[str, Heartbeat]] = {}
    for (queue, worker), beat in zip(pairs, beats):
        if beat is not None and beat.served_model_name and beat.serving(queue):
            by_queue.setdefault(queue, {})[worker] = beat
    found: dict[str, list[tuple[str, str, int, str]]] = {}
    for queue, live in by_queue.items():
        model = queue_model(live)       # a worker of another model there is about to exit
        if model is None:
            continue
        for worker, beat in live.items():
            if beat.served_model_name == model:
                found.setdefault(model, []).append(
                    (queue, worker, max(0, beat.started_ms), beat.tool_format))
    out = {}
    for name, live in sorted(found.items()):
        formats = {w[3] for w in live}           # "" (an older worker) disagrees with any
        out[name] = ServedModel(name=name, queues=tuple(sorted({w[0] for w in live})),
                                workers=tuple(sorted((w[0], w[1]) for w in live)),
                                created=min(w[2] for w in live) // 1000,
                                tool_format=(formats.pop() or None) if len(formats) == 1
                                else None)
    return out


def resolve_model(models: dict[str, ServedModel], model: str) -> ServedModel:
    """The live model a request names; ModelNotFound (listing what is served) when none is.
    The one resolution of a ``model``: the SDK's ``submit(model=)``, the batch runner and
    the gateway route through it."""
    found = models.get(model)
    if found is None:
        raise ModelNotFound(model, sorted(models))
    return found


def list_models(client: Any, namespace: str = "tokenrelay") -> dict[str, ServedModel]:
    """Model name -> ``ServedModel`` for every model live workers of ``namespace`` serve, over
    all its queues (a redis-py ``Redis``)."""
    return run(listing(namespace), lambda: client)


async def alist_models(client: Any, namespace: str = "tokenrelay") -> dict[str, ServedModel]:
    """``list_models`` on a ``redis.asyncio.Redis``."""
    async def conn() -> Any:
        return client
    return await arun(listing(namespace), conn)


class _TTL:
    """The last listing and when it stops being fresh (shared by both caches)."""

    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        if ttl_s < 0:
            raise ValueError(f"ttl_s must be >= 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self.clock = clock
        self.value: Optional[dict[str, ServedModel]] = None
        self.expires = 0.0

    def fresh(self) -> Optional[dict[str, ServedModel]]:
        return self.value if self.value is not None and self.clock() < self.expires else None

    def store(self, value: dict[str, ServedModel]) -> dict[str, ServedModel]:
        self.value, self.expires = value, self.clock() + self.ttl_s
        return value

    def invalidate(self) -> None:
        self.value = None


class ModelCache:
    """``list_models`` remembered for ``ttl_s`` seconds: a router calls ``get()`` per request
    and reads Redis at most once per TTL. A worker that died is dropped within the TTL plus
    its heartbeat's (5 beats); ``invalidate()`` forces a fresh read (e.g. after a 404)."""

    def __init__(self, client: Any, namespace: str = "tokenrelay", ttl_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client, self.namespace = client, namespace
        self._ttl = _TTL(ttl_s, clock)

    def get(self) -> dict[str, ServedModel]:
        fresh = self._ttl.fresh()
        return fresh if fresh is not None else self._ttl.store(
            list_models(self.client, self.namespace))

    def invalidate(self) -> None:
        self._ttl.invalidate()


class AsyncModelCache:
    """``ModelCache`` for asyncio: concurrent ``get()`` calls on a stale cache share one read."""

    def __init__(self, client: Any, namespace: str = "tokenrelay", ttl_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client, self.namespace = client, namespace
        self._ttl = _TTL(ttl_s, clock)
        self._lock = asyncio.Lock()

    async def get(self) -> dict[str, ServedModel]:
        fresh = self._ttl.fresh()
        if fresh is not None:
            return fresh
        async with self._lock:
            fresh = self._ttl.fresh()
            if fresh is not None:
                return fresh
            return self._ttl.store(await alist_models(self.client, self.namespace))

    def invalidate(self) -> None:
        self._ttl.invalidate()


__all__ = ["ServedModel", "resolve_model", "listing", "list_models", "alist_models", "ModelCache", "AsyncModelCache"]
