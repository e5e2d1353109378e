"""The enqueue core (producer_sdk/core/enqueue.py, core/client_core.py) without Redis: each scenario runs
on both clients against a script of replies, so every branch of the one enqueue -- a NOSCRIPT
reload, back-pressure refusals (high-water mark, OOM), waiting for room, a cluster's transient
replies, a lost connection -- is checked for Client and AsyncClient alike, in milliseconds."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import pytest
import redis
from redis.exceptions import NoScriptError, OutOfMemoryError, TryAgainError

from tokenrelay.producer_sdk import AsyncClient, Client, QueueFull, RedisUnavailable
from tokenrelay.producer_sdk.core import effects

Reply = Any     # one packed send's answer: (replies, trailer replies), or an exception to raise


def accepted(first: int, count: int, limit: int = 100_000, depth: int = -1, tokens: int = -1,
             token_limit: int = 0) -> list[Any]:
    """The enqueue script's reply accepting ``count`` jobs (entry ids from ``first``); the
    rest refused by the job count (``depth``) or the token budget (``tokens``)."""
    return [depth, limit, tokens, token_limit, *[f"{first + i}-0".encode() for i in range(count)]]


class ScriptedRedis:
    """Redis as a script: the config read and script loads answered in place, each packed send
    answered by the next item of ``sends``."""

    def __init__(self, sends: list[Reply]) -> None:
        self.sends = list(sends)
        self.loaded = 0
        self.sent: list[list[Any]] = []

    def script_load(self, lua: str) -> str:
        self.loaded += 1
        return "sha"

    def hmget(self, key: str, fields: list[str]) -> list[Any]:
        # no bound set; one shard registered (fields: limit, shards, token budget)
        return [b"1" if f == "shards" else None for f in fields]

    def close(self) -> None:
        pass

    def send(self, client: Any, items: Any, trailer: Any) -> tuple[list[Any], list[Any]]:
        self.sent.append(list(items))
        answer = self.sends.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer, [None] * len(items)


class AsyncScriptedRedis(ScriptedRedis):
    async def script_load(self, lua: str) -> str:      # type: ignore[override]
        return ScriptedRedis.script_load(self, lua)

    async def hmget(self, key: str, fields: list[str]) -> list[Any]:   # type: ignore[override]
        return ScriptedRedis.hmget(self, key, fields)

    async def aclose(self) -> None:
        pass

    async def asend(self, client: Any, items: Any, trailer: Any) -> tuple[list, list]:
        return self.send(client, items, trailer)


@pytest.fixture(params=["sync", "async"])
def submit_many(request, monkeypatch) -> Callable[..., Any]:
    """``submit_many(script, prompts, **kwargs)`` on a Client or an AsyncClient whose Redis is
    ``script``'s replies."""
    def call(sends: list[Reply], prompts: list[str], **kwargs: Any) -> tuple[Any, ScriptedRedis]:
        if request.param == "sync":
            fake = ScriptedRedis(sends)
            monkeypatch.setattr(effects, "send_packed_trailed", fake.send)
            with Client("redis://127.0.0.1:1/0", redis_client=fake, cluster=False) as c:
                return c.submit_many(prompts, max_tokens=1, **kwargs), fake
        afake = AsyncScriptedRedis(sends)
        monkeypatch.setattr(effects, "async_send_packed_trailed", afake.asend)

        async def main() -> Any:
            async with AsyncClient("redis://127.0.0.1:1/0", redis_client=afake,
                                   cluster=False) as c:
                return await c.submit_many(prompts, max_tokens=1, **kwargs)
        return asyncio.run(main()), afake
    return call


def test_a_noscript_reply_loads_the_script_and_sends_the_chunk_again(submit_many):
    jobs, fake = submit_many([[NoScriptError("NOSCRIPT")], [accepted(1, 3)]], ["a", "b", "c"])
    assert len(jobs) == 3 and not any(j.reattached for j in jobs)
    assert fake.loaded == 2 and len(fake.sent) == 2       # loaded up front, then again


def test_a_full_queue_refuses_at_once_without_block_and_names_what_went_in(submit_many):
    with pytest.raises(QueueFull) as err:
        submit_many([[accepted(1, 1, limit=5, depth=5)]], ["a", "b", "c"], block=False)
    assert (err.value.depth, err.value.limit, err.value.reason) == (5, 5, "high-water mark")
    assert len(err.value.accepted) == 1


def test_a_full_token_budget_refuses_naming_the_budget(submit_many):
    with pytest.raises(QueueFull) as err:
        submit_many([[accepted(1, 2, tokens=900, token_limit=1000)]], ["a", "b", "c"],
                    block=False)
    assert (err.value.tokens, err.value.token_limit, err.value.reason) == \
        (900, 1000, "token budget")
    assert err.value.depth is None and len(err.value.accepted) == 2
    assert "max_queued_tokens" in str(err.value) and "token budget" in str(err.value)


def test_redis_out_of_memory_is_back_pressure(submit_many):
    with pytest.raises(QueueFull) as err:
        submit_many([[OutOfMemoryError("OOM command not allowed")]], ["a", "b"], block=False)
    assert err.value.reason == "oom" and err.value.accepted == []


def test_a_blocking_submit_waits_for_room_and_sends_only_the_refused(submit_many):
    t0 = time.monotonic()
    jobs, fake = submit_many([[accepted(1, 1, limit=5, depth=5)], [accepted(2, 2)]],
                             ["a", "b", "c"], block=True, block_timeout=5)
    assert len(jobs) == 3 and time.monotonic() - t0 >= 0.02
    resent = fake.sent[1][0][1]()                        # the second round's script call
    assert resent.count(b"tokenrelay:job:") == 2         # the two refused jobs' dedupe keys


def test_a_transient_cluster_reply_is_sent_again(submit_many):
    jobs, fake = submit_many([[TryAgainError("TRYAGAIN")], [accepted(1, 2)]], ["a", "b"])
    assert len(jobs) == 2 and len(fake.sent) == 2


def test_a_lost_connection_to_one_redis_is_retried_once_then_unavailable(submit_many):
    lost = redis.ConnectionError("connection reset")
    t0 = time.monotonic()
    with pytest.raises(RedisUnavailable) as err:
        submit_many([lost, lost, [accepted(1, 1)]], ["a"])
    assert err.value.__cause__ is lost and 0.1 <= time.monotonic() - t0 < 2
