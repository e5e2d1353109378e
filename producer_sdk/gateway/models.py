"""Which models are served, and on which queue: what the gateway routes ``model`` by.

The listing itself is ``producer_sdk.core.models`` (the one reading of the workers' heartbeats,
shared with the batch runner); a ``ModelDirectory`` adds what the gateway needs on top:
``HeartbeatDirectory`` caches it for ``refresh_s`` (requests do not each read Redis) and
remembers every model it has seen or was configured with (``--routes``), so a model whose
workers all died answers 503 (come back later), not 404 (no such model).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

from tokenrelay.producer_sdk.core.models import AsyncModelCache, ServedModel
from tokenrelay.protocol.keys import Keys


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


class HeartbeatDirectory:
    """``ModelDirectory`` over ``producer_sdk.core.models`` in one namespace (redis.asyncio)."""

    def __init__(self, redis: Any, namespace: str, routes: Optional[dict[str, str]] = None,
                 refresh_s: float = 1.0) -> None:
        self.cache = AsyncModelCache(redis, namespace, ttl_s=refresh_s)
        self.seen: dict[str, str] = dict(routes or {})    # every model known -> its queue

    async def models(self) -> list[ServedModel]:
        found = await self.cache.get()
        for m in found.values():
            self.seen.setdefault(m.name, m.queue)
        return list(found.values())

    async def queue_for(self, model: str) -> Optional[str]:
        live = {m.name: m for m in await self.models()}.get(model)
        return live.queue if live is not None else None

    async def known_queue(self, model: str) -> Optional[str]:
        await self.models()
        return self.seen.get(model)
