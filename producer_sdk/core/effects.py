"""The producer SDK's one I/O style: plans yield effects, a driver performs them.

Everything the sync and async clients do with Redis is written once, as a *plan*: a generator
that yields effects (``Call`` a redis-py method, ``Send`` packed commands one round trip per
node, ``Sleep``), is sent each effect's result, has each effect's exception thrown in where it
yielded (so a plan retries, falls back or gives up as plain Python code), and returns its
answer. Plans compose with ``yield from``. The only code that differs between ``Client`` and
``AsyncClient`` is the pair of drivers here (``run``, ``arun``): how an effect is performed,
and whether that waits by blocking or by awaiting. Why: the two clients used to mirror each
other method for method, and every fix had to be made twice.

Every plan of the SDK is written in this style. The contract's own readers
(``protocol.heartbeat.live_beats``, shared with the worker, which has no effects) yield lists of
command tuples instead; ``pipelined`` runs one of those as a plan of effects.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Generator, Optional, Sequence, TypeVar, Union

from redis.exceptions import (AskError, AuthenticationError, AuthorizationError,
                              BusyLoadingError, ClusterDownError, ClusterError, NoScriptError,
                              OutOfMemoryError, RedisClusterException, ResponseError,
                              SlotNotCoveredError, TryAgainError)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tokenrelay.protocol.topology import (Packed, async_send_packed_trailed, is_cluster, refresh_any,
                               send_packed_trailed)

T = TypeVar("T")

# What an effect raises when Redis cannot be reached; a client turns one that leaves its plan
# into RedisUnavailable.
NET_ERRORS = (RedisConnectionError, RedisTimeoutError)
# What a packed send may raise while a cluster fails a master over (a lost connection, a slot
# map without a master for a slot for a moment).
SEND_ERRORS = (*NET_ERRORS, ClusterError, RedisClusterException)
# What a Redis Cluster answers while it fails a master over or moves a slot (CLUSTERDOWN,
# MASTERDOWN, TRYAGAIN, a MOVED/ASK redirect that outlived redis-py's own resend, a slot map
# without a master for a slot), and a server still loading its data: nothing is wrong with the
# request, it is to be sent again shortly.
CLUSTER_TRANSIENT = (ClusterDownError, TryAgainError, AskError, SlotNotCoveredError,
                     BusyLoadingError)
# Errors that retrying cannot fix although they subclass ConnectionError.
PERMANENT = (AuthenticationError, AuthorizationError)


@dataclass(frozen=True, slots=True)
class Call:
    """``fn(redis client)``: one command, a pipeline's execute, or a question about the client
    (``is_cluster``). A redis.asyncio client returns an awaitable, which the async driver
    awaits; a plain value is the result as it is."""

    fn: Callable[[Any], Any]


@dataclass(frozen=True, slots=True)
class Send:
    """Packed commands, one round trip per node (``topology.send_packed_trailed``); the result
    is ``(replies, trailer replies)``, error replies in place."""

    items: Sequence[Packed]
    trailer: Optional[bytes] = None


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait this long before going on (a back-off between retries)."""

    seconds: float


Effect = Union[Call, Send, Sleep]
Plan = Generator[Effect, Any, T]


def run(plan: Plan[T], conn: Callable[[], Any]) -> T:
    """Drive ``plan`` to its answer, blocking; ``conn()`` gives the redis-py client (called per
    effect, so a client made lazily is made by the first effect that needs it)."""
    result: Any = None
    error: Optional[Exception] = None
    try:
        while True:
            try:
                effect = plan.throw(error) if error is not None else plan.send(result)
            except StopIteration as done:
                return done.value
            result, error = None, None
            try:
                result = _perform(effect, conn)
            except Exception as exc:    # the plan's business: thrown in where it yielded
                error = exc
    finally:
        plan.close()


def _perform(effect: Effect, conn: Callable[[], Any]) -> Any:
    if isinstance(effect, Call):
        return effect.fn(conn())
    if isinstance(effect, Send):
        return send_packed_trailed(conn(), effect.items, effect.trailer)
    time.sleep(effect.seconds)
    return None


async def arun(plan: Plan[T], conn: Callable[[], Awaitable[Any]]) -> T:
    """``run`` on a redis.asyncio client: ``await conn()`` gives it."""
    result: Any = None
    error: Optional[Exception] = None
    try:
        while True:
            try:
                effect = plan.throw(error) if error is not None else plan.send(result)
            except StopIteration as done:
                return done.value
            result, error = None, None
            try:
                result = await _aperform(effect, conn)
            except Exception as exc:
                error = exc
    finally:
        plan.close()


async def _aperform(effect: Effect, conn: Callable[[], Awaitable[Any]]) -> Any:
    if isinstance(effect, Call):
        out = effect.fn(await conn())
        return await out if inspect.isawaitable(out) else out
    if isinstance(effect, Send):
        return await async_send_packed_trailed(await conn(), effect.items, effect.trailer)
    await asyncio.sleep(effect.seconds)
    return None


def is_transient(exc: BaseException, connection: bool = True) -> bool:
    """Whether ``exc`` is worth sending again: a cluster failing over (``CLUSTER_TRANSIENT``)
    and, with ``connection``, a lost or refused connection (never a refused password)."""
    if isinstance(exc, PERMANENT):
        return False
    if isinstance(exc, CLUSTER_TRANSIENT):
        return True
    return connection and isinstance(exc, NET_ERRORS)


def is_oom(reply: Any) -> bool:
    """Redis refused a write for maxmemory. Redis 7 returns the OOM error itself; Redis 6.2
    wraps it when it comes from inside a script ("Error running script ... -OOM command not
    allowed ..."), which redis-py then raises as a plain ResponseError."""
    return isinstance(reply, OutOfMemoryError) or (
        isinstance(reply, ResponseError) and "OOM command not allowed" in str(reply))


def raise_transient(replies: Sequence[Any]) -> Sequence[Any]:
    """Replies of a pipeline run with errors as values; the first transient error among them
    is raised (so ``retrying`` sends the whole step again), the others stay values."""
    for reply in replies:
        if isinstance(reply, BaseException) and is_transient(reply):
            raise reply
    return replies


def refresh_slots() -> Call:
    """Re-read a cluster client's slot map (nothing for one Redis); never raises."""
    return Call(refresh_any)


def retrying(make: Callable[[], Plan[T]], window_s: float, url: str,
             connection: bool = True) -> Plan[T]:
    """Run the plan ``make()`` gives; when it raises a transient error (``is_transient``: a
    cluster failing over and, with ``connection``, a lost connection) re-read the slot map and
    run a fresh one, pausing 0.05 s doubling to 1 s, for up to ``window_s``; past it raise
    RedisUnavailable. Only for plans that are safe to run again (reads, flags, the enqueue
    script, which dedupes by job id)."""
    from tokenrelay.producer_sdk.errors import RedisUnavailable
    give_up = time.monotonic() + window_s
    pause = 0.05
    while True:
        try:
            return (yield from make())
        except Exception as exc:
            if not is_transient(exc, connection):
                raise
            if time.monotonic() >= give_up:
                raise RedisUnavailable(url, exc) from exc
        try:
            yield refresh_slots()
        except Exception:       # the slot map is read again at the next try, whatever failed
            pass
        yield Sleep(pause)
        pause = min(pause * 2, 1.0)


def run_plan_script(script: Any, keys: Sequence[Any], args: Sequence[Any]) -> Plan[Any]:
    """One ``protocol.scripts`` script by EVALSHA, loaded first when the server answers
    NOSCRIPT (its keys share one slot, so a cluster client routes it by the first)."""
    def call(r: Any) -> Any:
        return r.evalsha(script.sha, len(keys), *keys, *args)
    try:
        return (yield Call(call))
    except NoScriptError:
        yield Call(lambda r: r.script_load(script.source))
        return (yield Call(call))


def cluster() -> Call:
    """Whether the client is a Redis Cluster client (no I/O once it is made)."""
    return Call(is_cluster)


def pipeline(commands: Sequence[tuple[Any, ...]], transaction: bool = False,
             raise_on_error: bool = True) -> Call:
    """One pipeline of raw commands (``execute_command`` tuples); the result is their replies."""
    def execute(client: Any) -> Any:
        pipe = client.pipeline(transaction=transaction)
        for command in commands:
            pipe.execute_command(*command)
        return pipe.execute(raise_on_error)
    return Call(execute)


def pipelined(plan: Generator[Sequence[tuple[Any, ...]], list[Any], T]) -> Plan[T]:
    """A plan of the pipeline style (it yields lists of commands and is sent their replies)
    as a plan of effects."""
    try:
        commands = next(plan)
        while True:
            commands = plan.send((yield pipeline(commands)))
    except StopIteration as done:
        return done.value


__all__ = ["Call", "Send", "Sleep", "Effect", "Plan", "run", "arun", "cluster", "pipeline",
           "pipelined", "retrying", "run_plan_script", "is_transient", "is_oom", "raise_transient", "refresh_slots",
           "NET_ERRORS", "SEND_ERRORS", "CLUSTER_TRANSIENT"]
