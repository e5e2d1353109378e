"""Which models are served, and on which queue: what the gateway routes ``model`` by.

Workers announce themselves: each beats a hash ``Keys.heartbeat(worker_id)`` (with a TTL of
five beats) holding its ``queue`` and ``model`` -- and ``served_model_name`` where the worker
sets one -- and scores itself in the per-queue sorted set ``Keys.workers``. A model is *live*
while at least one worker serving it has a heartbeat with its engine loaded and is not
draining. The gateway asks a ``ModelDirectory``; ``HeartbeatDirectory`` reads the heartbeats
(cached for ``refresh_s``, so requests do not each scan Redis) and remembers every model it has
seen, so a model whose workers all died answers 503 (come back later), not 404 (no such model).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Optional, Protocol, Sequence

from producer_sdk.protocol import Keys

FAKE_PREFIX = "fake:"


@dataclass(frozen=True, slots=True)
class ServedModel:
    """A live model: its name, the queue its workers read, when its first live worker started
    (epoch seconds: OpenAI's ``created``), and how many live workers serve it."""

    name: str
    queue: str
    created: int
    workers: int


class ModelDirectory(Protocol):
    """What the gateway needs to route a request by its ``model``."""

    async def models(self) -> list[ServedModel]:
        """Every live model."""
        ...

    async def queue_for(self, model: str) -> Optional[str]:
        """The queue of a live model, or None when no live worker serves it."""
        ...

    async def known_queue(self, model: str) -> Optional[str]:
        """The queue of a model configured or served before, live or not (so a model with no
        live worker is a 503, come back later, rather than a 404, no such model)."""
        ...


def served_name(beat: dict[str, str]) -> str:
    """A heartbeat's model name: ``served_model_name`` when the worker sends one, else the
    checkpoint folder's name (``/models/Qwen3-8B/`` -> ``Qwen3-8B``); ``fake:...`` -> ``fake``."""
    name = beat.get("served_model_name")
    if name:
        return name
    model = beat.get("model", "")
    if model.startswith(FAKE_PREFIX):
        return FAKE_PREFIX.rstrip(":")
    return PurePosixPath(model.rstrip("/")).name or model


def parse_routes(routes: Sequence[str]) -> dict[str, str]:
    """``["MODEL=QUEUE", ...]`` -> ``{model: queue}``; ValueError naming a malformed entry."""
    out = {}
    for entry in routes:
        model, sep, queue = entry.rpartition("=")
        if not sep or not model or not queue:
            raise ValueError(f"route {entry!r} is not MODEL=QUEUE")
        Keys("ns", queue)       # raises ValueError for a queue name no key could hold
        out[model] = queue
    return out


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class HeartbeatDirectory:
    """``ModelDirectory`` over the workers' heartbeats in one namespace (redis.asyncio)."""

    def __init__(self, redis: Any, namespace: str, routes: Optional[dict[str, str]] = None,
                 refresh_s: float = 1.0) -> None:
        self.redis = redis
        self.namespace = namespace
        self.refresh_s = refresh_s
        self.seen: dict[str, str] = dict(routes or {})    # every model known -> its queue
        self._cache: tuple[float, list[ServedModel]] = (-1e18, [])

    async def models(self) -> list[ServedModel]:
        at, cached = self._cache
        if time.monotonic() - at < self.refresh_s:
            return cached
        found = await self._read()
        self._cache = (time.monotonic(), found)
        for m in found:
            self.seen.setdefault(m.name, m.queue)
        return found

    async def queue_for(self, model: str) -> Optional[str]:
        live = [m for m in await self.models() if m.name == model]
        return max(live, key=lambda m: m.workers).queue if live else None

    async def known_queue(self, model: str) -> Optional[str]:
        await self.models()
        return self.seen.get(model)

    async def _queues(self) -> list[str]:
        prefix = f"{self.namespace}:workers:"
        queues = set()
        async for key in self.redis.scan_iter(match=prefix + "*", count=1000):
            queues.add(_text(key)[len(prefix):])
        return sorted(queues)

    async def _read(self) -> list[ServedModel]:
        """One scan for the queues, one round trip for the worker ids, one for their beats."""
        queues = await self._queues()
        if not queues:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for q in queues:
            pipe.zrange(Keys(self.namespace, q).workers, 0, -1)
        ids = [(q, _text(w)) for q, members in zip(queues, await pipe.execute()) for w in members]
        pipe = self.redis.pipeline(transaction=False)
        for q, wid in ids:
            pipe.hgetall(Keys(self.namespace, q).heartbeat(wid))
        by_name: dict[tuple[str, str], list[int]] = {}
        for (q, _), raw in zip(ids, await pipe.execute()):
            beat = {_text(k): _text(v) for k, v in raw.items()}
            if not beat or beat.get("engine_loaded") != "1" or beat.get("draining") == "1":
                continue
            if beat.get("queue", q) != q:
                continue
            started = int(beat.get("started_ms") or 0) // 1000
            by_name.setdefault((served_name(beat), q), []).append(started)
        return sorted((ServedModel(name, q, min(starts), len(starts))
                       for (name, q), starts in by_name.items()), key=lambda m: (m.name, m.queue))
