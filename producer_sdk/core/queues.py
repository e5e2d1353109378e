"""What a producer knows of each queue it sends to: its keys with the shard count resolved, and
its high-water mark, read from the queue's config hash at most once per ``CONFIG_TTL_S``.

The shard count is never guessed for an enqueue: before a job goes in, the queue's count is
registered (HSETNX of the same field workers register, so the first producer or worker decides)
and read back in one MULTI. Why: a producer that guessed 1 while the first worker later
registered 3 left every job it had sent in a lane no worker reads (issue #25).

One ``QueueBook`` per client, shared by every call of it; its reads are plans
(``producer_sdk.core.effects``), run by whichever client owns it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from redis.exceptions import ResponseError

from tokenrelay.producer_sdk.core.effects import Call, Plan, is_oom
from tokenrelay.protocol.keys import Keys
from tokenrelay.protocol.scripts import pack
from tokenrelay.protocol.topology import Packed
from tokenrelay.protocol.shards import SHARDS_FIELD, ShardCountMismatch, parse_shards, resolve_shards

LIMIT_FIELD = "max_queued_jobs"
TOKENS_FIELD = "max_queued_tokens"    # the token budget (protocol/budget.py); absent: none
# How long a producer reuses a queue's high-water mark (and watches for a shard count being
# registered) before reading its config hash again: one HMGET per queue per second of submits.
CONFIG_TTL_S = 1.0
_FIELDS = [LIMIT_FIELD, SHARDS_FIELD, TOKENS_FIELD]   # what a producer reads of the config hash
DEFAULT_MAX_QUEUED_JOBS = 100_000


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


class QueueBook:
    """Per queue of the namespace (None: the client's own): a ``QueueState``.

    The shard count is the one registered in the queue's config hash; an enqueue registers
    ``shards`` (the client's setting, its own queue only; else 1) first when none is
    (``state(register=True)``), and a client whose ``shards`` differs from the registered count
    is refused (ShardCountMismatch). A registered count is kept for the client's life (a queue
    resharded under it raises ShardCountMismatch rather than sending jobs where no worker
    reads). Reads that enqueue nothing (status, depth) register nothing: until a count is
    registered they use ``shards`` or 1 and follow a later registration. The high-water mark
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

    def state(self, queue: Optional[str] = None, fresh: bool = False,
              register: bool = False) -> Plan[QueueState]:
        """The queue's state, reading its config hash when unknown (or due, with ``fresh``).
        ``register`` (every enqueue): a state whose count is not registered yet is read
        again, and when the hash holds no count this client's is registered (HSETNX, then
        HMGET, in one MULTI: no write once a count is registered)."""
        st = self.cached(queue, fresh)
        if st is not None and (st.registered or not register):
            return st
        key = self.config_key(queue)
        limit, shards, tokens = yield Call(lambda r: r.hmget(key, _FIELDS))
        if register and shards is None:
            count = self.registering(queue)
            try:
                reply = yield Call(lambda r: _register_and_read(r, key, count))
                limit, shards, tokens = reply[1]
            except ResponseError as exc:
                if not is_oom(exc) and "OOM" not in str(exc):
                    raise
                # Redis refuses writes (maxmemory): so will the enqueue that follows, which
                # turns it into back-pressure; the count is registered at its next round.
        return self.store(queue, limit, shards, tokens)

    def registering(self, queue: Optional[str]) -> int:
        """The count this client registers for ``queue`` when none is: the one it knew
        registered (the field was lost with a Redis restart), else its own ``shards`` (its own
        queue only), else 1."""
        name = queue or self.queue
        old = self._states.get(name)
        if old is not None and old.registered:
            return old.keys.shards
        return (self.shards if name == self.queue else None) or 1

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


def _register_and_read(r: Any, key: str, count: int) -> Any:
    """MULTI: HSETNX the shard count (a no-op when one is registered), HMGET the bounds and count.
    One key, so one slot on a Redis Cluster; an asyncio client returns an awaitable."""
    pipe = r.pipeline(transaction=True)
    pipe.hsetnx(key, SHARDS_FIELD, count)
    pipe.hmget(key, _FIELDS)
    return pipe.execute()


__all__ = ["QueueBook", "QueueState", "LIMIT_FIELD", "TOKENS_FIELD", "CONFIG_TTL_S",
           "DEFAULT_MAX_QUEUED_JOBS", "xlen_reads", "shard_depths"]
