"""What a producer knows of each queue it sends to: its keys with the shard count resolved, and
its high-water mark, read from the queue's config hash at most once per ``CONFIG_TTL_S``.

One ``QueueBook`` per client, shared by every call of it; its reads are plans
(``producer_sdk.effects``), run by whichever client owns it.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from producer_sdk._wire import DEFAULT_MAX_QUEUED_JOBS, QueueState
from producer_sdk.effects import Call, Plan
from protocol.keys import Keys
from protocol.shards import SHARDS_FIELD, ShardCountMismatch, parse_shards, resolve_shards

LIMIT_FIELD = "max_queued_jobs"
TOKENS_FIELD = "max_queued_tokens"    # the token budget (protocol/budget.py); absent: none
# How long a producer reuses a queue's high-water mark (and watches for a shard count being
# registered) before reading its config hash again: one HMGET per queue per second of submits.
CONFIG_TTL_S = 1.0


class QueueBook:
    """Per queue of the namespace (None: the client's own): a ``QueueState``.

    The shard count is ``shards`` (the client's setting, its own queue only) or the one the
    queue's workers registered, else 1; a registered count is kept for the client's life (a
    queue resharded under it raises ShardCountMismatch rather than sending jobs where no worker
    reads), while a count not registered yet follows a later registration. The high-water mark
    is ``max_queued_jobs`` (the client's own), else the config hash's, else the default; the
    token budget likewise ``max_queued_tokens``, else the config hash's, else none."""

    def __init__(self, namespace: str, queue: str, shards: Optional[int],
                 max_queued_jobs: Optional[int], max_queued_tokens: Optional[int] = None,
                 ) -> None:
        self.namespace = namespace
        self.queue = queue
        self.shards = shards
        self.max_queued_jobs = max_queued_jobs
        self.max_queued_tokens = max_queued_tokens
        self._states: dict[str, QueueState] = {}

    def config_key(self, queue: Optional[str] = None) -> str:
        return Keys(self.namespace, queue or self.queue).config

    def cached(self, queue: Optional[str] = None, fresh: bool = False) -> Optional[QueueState]:
        """The queue's state when known (and, with ``fresh``, not due for a re-read)."""
        st = self._states.get(queue or self.queue)
        if st is None or (fresh and time.monotonic() >= st.expires):
            return None
        return st

    def state(self, queue: Optional[str] = None, fresh: bool = False) -> Plan[QueueState]:
        """The queue's state, reading its config hash when unknown (or due, with ``fresh``)."""
        st = self.cached(queue, fresh)
        if st is None:
            key = self.config_key(queue)
            limit, shards, tokens = yield Call(
                lambda r: r.hmget(key, [LIMIT_FIELD, SHARDS_FIELD, TOKENS_FIELD]))
            st = self.store(queue, limit, shards, tokens)
        return st

    def keys(self, queue: Optional[str] = None) -> Plan[Keys]:
        return (yield from self.state(queue)).keys

    def store(self, queue: Optional[str], raw_limit: Any, raw_shards: Any,
              raw_tokens: Any = None) -> QueueState:
        """What the queue's config hash says, checked against what this book knew."""
        name = queue or self.queue
        base = Keys(self.namespace, name)
        old = self._states.get(name)
        registered = parse_shards(raw_shards, base.config)
        if registered is None and old is not None and old.registered:
            registered = old.keys.shards    # the field was deleted under a live client
        count = resolve_shards(self.shards if name == self.queue else None, registered, base)
        if old is not None and old.registered and old.keys.shards != count:
            raise ShardCountMismatch(
                f"queue {name!r} was registered with {old.keys.shards} shards when this client "
                f"first used it and now with {count} ({base.config}): it was resharded; "
                f"create a new client")
        keys = old.keys if old is not None and old.keys.shards == count else \
            Keys(self.namespace, name, count)
        st = QueueState(keys, self._limit(raw_limit), registered is not None,
                        time.monotonic() + CONFIG_TTL_S,
                        _count(self.max_queued_tokens, raw_tokens, 0))
        self._states[name] = st
        return st

    def _limit(self, raw: Any) -> int:
        return _count(self.max_queued_jobs, raw, DEFAULT_MAX_QUEUED_JOBS)

    def set_limit(self, limit: int, queue: Optional[str] = None,
                  field: str = LIMIT_FIELD) -> Plan[None]:
        """Set one of the queue's shared bounds (``LIMIT_FIELD``: the high-water mark,
        ``TOKENS_FIELD``: the token budget); this book reads them again on next use."""
        key = self.config_key(queue)
        yield Call(lambda r: r.hset(key, field, int(limit)))
        st = self._states.get(queue or self.queue)
        if st is not None:
            st.expires = 0.0


def _count(own: Optional[int], raw: Any, default: int) -> int:
    """A bound: the client's own, else the config hash's value (``raw``), else ``default``
    (also for a value that is no integer); 0 means none."""
    if own is not None:
        return own
    try:
        return max(0, int(raw)) if raw is not None else default
    except ValueError:
        return default


__all__ = ["QueueBook", "LIMIT_FIELD", "TOKENS_FIELD", "CONFIG_TTL_S"]
