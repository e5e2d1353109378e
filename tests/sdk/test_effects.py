"""The two drivers of the SDK's plans (producer_sdk/core/effects.py) behave alike: each effect's
result is sent back, its exception is thrown in where the plan yielded, a plan is closed when
its driver stops, and the async driver awaits only what is awaitable."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis

from tokenrelay.producer_sdk.core.effects import Call, Plan, Sleep, arun, pipelined, run


class FakeRedis:
    """Answers ``get`` from a dict; ``broken`` keys raise a lost connection."""

    def __init__(self, data: dict[str, Any], broken: frozenset[str] = frozenset()) -> None:
        self.data, self.broken, self.calls = data, broken, 0

    def get(self, key: str) -> Any:
        self.calls += 1
        if key in self.broken:
            raise redis.ConnectionError(f"lost while reading {key}")
        return self.data.get(key)

    def pipeline(self, transaction: bool = False) -> "FakePipe":
        return FakePipe(self)


class FakePipe:
    def __init__(self, r: FakeRedis) -> None:
        self.r, self.commands = r, []

    def execute_command(self, *args: Any) -> None:
        self.commands.append(args)

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        return [self.r.data.get(key) for _, key in self.commands]


class AsyncFakeRedis(FakeRedis):
    async def get(self, key: str) -> Any:     # type: ignore[override]
        await asyncio.sleep(0)
        return FakeRedis.get(self, key)


def sum_with_fallback(keys: list[str], log: list[str]) -> Plan[int]:
    """Adds the values of ``keys``; a key whose read fails counts 0, after a pause."""
    total = 0
    try:
        for key in keys:
            try:
                total += int((yield Call(lambda r, k=key: r.get(k))) or 0)
            except redis.ConnectionError:
                log.append(f"lost {key}")
                yield Sleep(0.01)
        return total
    finally:
        log.append("closed")


def both_drivers(plan_of: Any, client: FakeRedis, aclient: AsyncFakeRedis) -> tuple[Any, Any]:
    async def conn() -> Any:
        return aclient
    return run(plan_of(), lambda: client), asyncio.run(arun(plan_of(), conn))


def test_results_come_back_and_errors_are_thrown_in_where_the_plan_yielded():
    data = {"a": "1", "b": "2", "c": "4"}
    log: list[str] = []
    t0 = time.monotonic()
    got = both_drivers(lambda: sum_with_fallback(["a", "b", "c"], log),
                       FakeRedis(data, frozenset({"b"})), AsyncFakeRedis(data, frozenset({"b"})))
    assert got == (5, 5)
    assert log == ["lost b", "closed"] * 2
    assert time.monotonic() - t0 >= 0.02          # each driver slept once


def test_an_error_the_plan_does_not_catch_leaves_the_driver_and_closes_the_plan():
    def plan() -> Plan[Any]:
        try:
            yield Call(lambda r: r.get("x"))
        finally:
            log.append("closed")

    log: list[str] = []
    with pytest.raises(redis.ConnectionError, match="lost while reading x"):
        run(plan(), lambda: FakeRedis({}, frozenset({"x"})))

    async def conn() -> Any:
        return AsyncFakeRedis({}, frozenset({"x"}))
    with pytest.raises(redis.ConnectionError):
        asyncio.run(arun(plan(), conn))
    assert log == ["closed", "closed"]


def test_the_async_driver_awaits_only_what_is_awaitable_and_connects_per_effect():
    made: list[int] = []
    client = AsyncFakeRedis({"k": "v"})

    async def conn() -> Any:
        made.append(1)
        return client

    def plan() -> Plan[tuple[Any, Any]]:
        plain = yield Call(lambda r: type(r).__name__)      # a question, not a command
        value = yield Call(lambda r: r.get("k"))            # a coroutine: awaited
        return plain, value

    assert asyncio.run(arun(plan(), conn)) == ("AsyncFakeRedis", "v")
    assert len(made) == 2


def test_a_plan_without_effects_touches_no_client():
    def plan() -> Plan[str]:
        return "answered"
        yield  # noqa: unreachable - a generator that answers at once

    def no_client() -> Any:
        raise AssertionError("connected")
    assert run(plan(), no_client) == "answered"


def test_a_pipeline_style_plan_runs_through_pipelined():
    def listing() -> Any:
        first = yield [("GET", "a"), ("GET", "b")]
        second = yield [("GET", first[0])]
        return first + second

    got = both_drivers(lambda: pipelined(listing()), FakeRedis({"a": "b", "b": "x"}),
                       AsyncFakeRedis({"a": "b", "b": "x"}))
    assert got == (["b", "x", "x"], ["b", "x", "x"])
