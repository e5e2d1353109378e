"""The gateway compile-checks a request's constraint off its event loop (issue #42: a 64 KiB
schema cost 145-176 ms of the loop, 40 of them stalled neighbour streams and ``/health`` by
over a second). The check is made slow on purpose (1 s, cached as the real one is): it runs
on a thread other than the loop's, and ``/health`` keeps answering meanwhile."""

from __future__ import annotations

import functools
import threading
import time

import httpx
import pytest

from tokenrelay.protocol import structured_outputs

pytestmark = pytest.mark.timeout(60)
SLOW_S = 1.0


def test_a_slow_constraint_check_leaves_the_loop_free(redis_server, gateway_factory,
                                                      monkeypatch):
    threads: list[str] = []

    @functools.lru_cache(maxsize=16)
    def slow_problem(canonical: str, probe: bool = True) -> str:
        threads.append(threading.current_thread().name)
        time.sleep(SLOW_S)
        return ""
    monkeypatch.setattr(structured_outputs, "grammar_problem", slow_problem)
    gw = gateway_factory(redis_server.url, routes=["fake=nobody"])
    schema = {"type": "object", "properties": {f"f{i}": {"type": "string"} for i in range(50)}}
    answered: list[int] = []

    def post() -> None:
        answered.append(httpx.post(f"{gw.v1}/chat/completions", timeout=30, headers={
            "x-wait-for-worker": "1", "x-request-timeout": "2"}, json={
            "model": "fake", "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "r", "schema": schema}}}).status_code)
    poster = threading.Thread(target=post)
    poster.start()
    health = []
    t0 = time.monotonic()
    while poster.is_alive() and time.monotonic() - t0 < 20:
        t = time.monotonic()
        assert httpx.get(f"{gw.url}/health", timeout=10).status_code == 200
        health.append(time.monotonic() - t)
        time.sleep(0.05)
    poster.join(20)
    assert answered == [504], answered    # validated, enqueued, no worker came within 2 s
    assert threads and not any(n.startswith("gateway-") for n in threads), threads
    assert len(health) >= 5 and max(health) < SLOW_S / 2, health
